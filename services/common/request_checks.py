"""Checks of the fields the router decides and the target takes on trust no longer.

The router builds these fields (speculation plan, bucket, priority); the target receives them
from any caller with the router's certificate, so it checks them again with the same functions
from this one module: the two sides cannot drift.

What each check does with a bad value:
- `SpeculationPlan.method` not a known SpeculationMethod -> INVALID_ARGUMENT (speculation.method).
- `max_depth` / `max_nodes` negative -> INVALID_ARGUMENT; above the draft's limits
  (MAX_DEPTH, MAX_NODES of services/common/speculation_plan.py, the draft service's defaults) -> clamped to them, so a
  plan never asks the draft for what it refuses (a refused sequence loses its drafts).
- `priority` outside [MIN_PRIORITY, MAX_PRIORITY] -> INVALID_ARGUMENT (priority).
- `bucket` longer than MAX_BUCKET_CHARS or with characters outside [A-Za-z0-9._-] ->
  INVALID_ARGUMENT (bucket). Buckets become metric labels: `BucketLabels` also bounds how
  many distinct ones a process labels with (the rest share OTHER_BUCKET).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass

from services.common.errors import Violation
from services.common.speculation_plan import MAX_DEPTH, MAX_NODES
from specmesh.proto.v1 import common_pb2

MIN_PRIORITY, MAX_PRIORITY = -100, 100
MAX_BUCKET_CHARS = 64
MAX_BUCKET_LABELS = 64  # distinct bucket names per process used as metric labels
OTHER_BUCKET = "other"
_BUCKET = re.compile(r"[A-Za-z0-9._-]*")
KNOWN_METHODS = frozenset(common_pb2.SpeculationMethod.values())


@dataclass(frozen=True)
class CheckedPlan:
    """A speculation plan within the draft's limits; `method` is a known SpeculationMethod."""

    method: int
    max_depth: int  # 0 = no speculation
    max_nodes: int  # >= max_depth when speculating
    load_aware: bool
    acceptance_prior: float  # in (0, 1), or 0 = no prediction


def plan_violations(plan: common_pb2.SpeculationPlan) -> list[Violation]:
    """What is wrong with a plan beyond clamping (empty when `checked_plan` may be called)."""
    problems = []
    if plan.method not in KNOWN_METHODS:
        problems.append(Violation("speculation.method", f"unknown speculation method {plan.method}; "
                                  f"expected one of {sorted(KNOWN_METHODS)}"))
    for name in ("max_depth", "max_nodes"):
        if getattr(plan, name) < 0:
            problems.append(Violation(f"speculation.{name}", f"{name} {getattr(plan, name)} is negative"))
    return problems


def checked_plan(plan: common_pb2.SpeculationPlan) -> CheckedPlan:
    """The plan with depth and node budget clamped to the draft's limits (after
    `plan_violations` found nothing). Off, unspecified or depth 0 give max_depth 0."""
    off = plan.method in (common_pb2.SPECULATION_METHOD_UNSPECIFIED, common_pb2.SPECULATION_METHOD_OFF)
    depth = 0 if off else min(max(plan.max_depth, 0), MAX_DEPTH)
    nodes = min(max(plan.max_nodes, depth), MAX_NODES) if depth else 0
    prior = plan.acceptance_prior
    prior = prior if math.isfinite(prior) and 0.0 < prior < 1.0 else 0.0
    return CheckedPlan(plan.method, depth, nodes, plan.load_aware, prior)


def priority_violations(priority: int) -> list[Violation]:
    if MIN_PRIORITY <= priority <= MAX_PRIORITY:
        return []
    return [Violation("priority", f"priority {priority} is outside [{MIN_PRIORITY}, {MAX_PRIORITY}]")]


def bucket_violations(bucket: str) -> list[Violation]:
    if len(bucket) > MAX_BUCKET_CHARS:
        return [Violation("bucket", f"bucket name of {len(bucket)} characters is longer than "
                          f"{MAX_BUCKET_CHARS}")]
    if not _BUCKET.fullmatch(bucket):
        return [Violation("bucket", "bucket name may hold only letters, digits, '.', '_' and '-'")]
    return []


def routing_violations(plan: common_pb2.SpeculationPlan, bucket: str, priority: int) -> list[Violation]:
    """Every problem with the fields the router sets on a target request."""
    return [*plan_violations(plan), *bucket_violations(bucket), *priority_violations(priority)]


class BucketLabels:
    """Bounds the label values metrics see: the first MAX_BUCKET_LABELS distinct buckets keep
    their name, later ones are counted under OTHER_BUCKET (thread safe)."""

    def __init__(self, max_labels: int = MAX_BUCKET_LABELS) -> None:
        self.max_labels = max_labels
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def label(self, bucket: str) -> str:
        if bucket in self._seen:
            return bucket
        with self._lock:
            if len(self._seen) >= self.max_labels:
                return OTHER_BUCKET
            self._seen.add(bucket)
            return bucket
