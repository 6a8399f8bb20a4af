"""Per-bucket speculation plans from measured acceptance (DESIGN sections 1 and 5).

The router sees every request's final usage (proposed / accepted tokens, acceptance
length τ). Per bucket it keeps a moving estimate of the acceptance rate α and picks the
draft depth d that maximises the expected speedup

    E[A](d) / cost(d),   E[A](d) = (1 - α^(d+1)) / (1 - α)   (accepted + bonus per pass)
    cost(d) = verify_overhead + verify_cost_per_token * d      (in decode-step units)

turning speculation off when no depth beats 1. An "off" bucket still speculates on
every `probe_every`-th request (at the shortest depth), so it can come back when the
traffic changes. `fixed` mode always returns the configured plan.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    mode: str = "fixed"  # "fixed" | "adaptive"
    max_depth: int = 10
    ewma: float = 0.3  # weight of the newest request in the acceptance estimate
    min_proposed: int = 8  # requests proposing fewer draft tokens say too little to count
    verify_overhead: float = 1.05  # a verify pass with no draft tokens, in decode steps
    verify_cost_per_token: float = 0.04  # measured here: depth 5 ~1.27, depth 10 ~1.46 steps
    probe_every: int = 8

    def __post_init__(self) -> None:
        if self.mode not in ("fixed", "adaptive"):
            raise ValueError(f"speculation policy mode must be 'fixed' or 'adaptive', got {self.mode!r}")
        if not 1 <= self.max_depth <= 16:
            raise ValueError(f"max_depth must be in [1, 16], got {self.max_depth}")
        if not 0 < self.ewma <= 1:
            raise ValueError(f"ewma must be in (0, 1], got {self.ewma}")


@dataclass
class _BucketState:
    acceptance: float | None = None  # α estimate
    requests: int = 0


class SpeculationPolicy:
    """Chooses the draft depth per bucket; 0 means speculation off for that request."""

    def __init__(self, config: PolicyConfig, default_depth: int) -> None:
        self.config = config
        self.default_depth = default_depth
        self._buckets: dict[str, _BucketState] = {}
        self._lock = threading.Lock()

    def depth(self, bucket: str) -> int:
        if self.config.mode == "fixed":
            return self.default_depth
        with self._lock:
            state = self._buckets.setdefault(bucket, _BucketState())
            state.requests += 1
            if state.acceptance is None:
                return self.default_depth  # nothing measured yet
            best_depth, best_speedup = best_depth_for(state.acceptance, self.config)
            if best_speedup > 1.0:
                return best_depth
            return 1 if state.requests % self.config.probe_every == 0 else 0

    def observe(self, bucket: str, proposed: int, accepted: int) -> None:
        """Feeds one finished request's speculation counters back."""
        if self.config.mode == "fixed" or proposed < self.config.min_proposed:
            return
        rate = min(max(accepted / proposed, 0.0), 0.999)
        with self._lock:
            state = self._buckets.setdefault(bucket, _BucketState())
            w = self.config.ewma
            state.acceptance = rate if state.acceptance is None else (1 - w) * state.acceptance + w * rate

    def acceptance(self, bucket: str) -> float | None:
        with self._lock:
            state = self._buckets.get(bucket)
            return None if state is None else state.acceptance


def best_depth_for(alpha: float, config: PolicyConfig) -> tuple[int, float]:
    """(depth, expected speedup) maximising E[A](d) / cost(d) for acceptance rate `alpha`."""
    best = (1, 0.0)
    for d in range(1, config.max_depth + 1):
        expected = (1 - alpha ** (d + 1)) / (1 - alpha)
        speedup = expected / (config.verify_overhead + config.verify_cost_per_token * d)
        if speedup > best[1] + 1e-9:
            best = (d, speedup)
    return best
