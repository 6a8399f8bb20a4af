"""The request contract across the gRPC seam: one set of checks the router and the target both run.

The router checks a caller's GenerateRequest with `check_request` before any work; the target
receives the router's TargetServiceGenerateRequest from any caller holding the router's
certificate, so it runs the same `check_request` on what it receives (the two messages share
the fields read here: prompt, messages, tools, sampling) and answers the same bad input with
the same status, message and field violations. It then checks the fields the router decides
(speculation plan, bucket, priority) with `routing_violations`. What only the target can
check (prompt plus max_tokens against the model's context and the KV capacity, logit_bias ids
against the vocabulary, a constraint's compiled grammar) stays with the target's engine and
compiler.

`check_request` raises a `Refusal` (INVALID_ARGUMENT) listing every problem as a field
violation: reason REQUEST_TOO_LARGE when a size limit is exceeded (checked first: sizes bound
the work of every later check), INVALID_REQUEST otherwise. It returns a `CheckedRequest`: the
sampling parsed into a `SamplingConfig` once, the sample count and the constraint, which the
caller uses from then on instead of reading the proto again.

What the routing checks do with a bad value:
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

import grpc

from services.common.constraints import ConstraintSpec, constraint_from_proto, constraint_violations
from services.common.errors import Refusal, Violation
from services.common.limits import RequestLimits
from services.common.sample_count import num_samples, sample_count_violations
from services.common.sampling_params import SamplingConfig, params_violations, sampling_from_proto
from services.common.speculation_plan import MAX_DEPTH, MAX_NODES
from specmesh.proto.v1 import common_pb2

MIN_PRIORITY, MAX_PRIORITY = -100, 100
MAX_BUCKET_CHARS = 64
MAX_BUCKET_LABELS = 64  # distinct bucket names per process used as metric labels
OTHER_BUCKET = "other"
_BUCKET = re.compile(r"[A-Za-z0-9._-]*")
KNOWN_METHODS = frozenset(common_pb2.SpeculationMethod.values())


@dataclass(frozen=True)
class CheckedRequest:
    """What `check_request` read from a valid request, parsed once."""

    sampling: SamplingConfig
    n: int  # samples of the prompt, >= 1
    constraint: ConstraintSpec | None  # None: unconstrained


def check_request(request, limits: RequestLimits, max_tokens_limit: int, max_samples: int) -> CheckedRequest:
    """The checked request (a router GenerateRequest or a TargetServiceGenerateRequest);
    raises Refusal listing every problem (see the module docstring)."""
    params = request.sampling
    too_large = limits.violations([request.prompt, *(m.content for m in request.messages), *tool_texts(request)],
                                  params.stop, "messages" if request.messages else "prompt")
    if too_large:
        raise refusal(too_large, "REQUEST_TOO_LARGE")
    constraint = constraint_from_proto(params)
    problems = [Violation(f"sampling.{field}", message) for field, message in params_violations(params)]
    problems += [Violation(f"sampling.{field}", message) for field, message in constraint_violations(constraint)]
    if request.prompt and request.messages:
        problems.append(Violation("prompt", "set prompt or messages, not both"))
    elif request.messages:
        if not any(m.content.strip() for m in request.messages):
            problems.append(Violation("messages", "messages are empty"))
    elif not request.prompt.strip():
        problems.append(Violation("prompt", "prompt is empty"))
    if request.tools and not request.messages:
        problems.append(Violation("tools", "tools need messages (a chat request)"))
    if params.max_tokens > max_tokens_limit:
        problems.append(Violation("sampling.max_tokens", f"max_tokens {params.max_tokens} is above "
                                  f"the limit {max_tokens_limit}"))
    problems += [Violation(field, message) for field, message in sample_count_violations(
        params.n, params.seed if params.has_seed else None, max_samples)]
    if problems:
        raise refusal(problems, "INVALID_REQUEST")
    return CheckedRequest(sampling_from_proto(params), num_samples(params.n), constraint)


def tool_texts(request) -> list[str]:
    """The caller-controlled text of a request's tools and tool calls, for the size limits."""
    texts = [text for tool in request.tools for text in (tool.name, tool.description, tool.parameters_json)]
    for message in request.messages:
        texts.extend(text for call in message.tool_calls for text in (call.id, call.name, call.arguments_json))
        texts.extend((message.tool_call_id, message.name))
    return [text for text in texts if text]


def refusal(problems: list[Violation], reason: str) -> Refusal:
    """INVALID_ARGUMENT naming every problem (the message joins their descriptions)."""
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(v.description for v in problems), reason, problems)


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
