"""Speculation plans at the router, per request.

1. `SpeculationPolicy` (router, per request). Predicts the acceptance rate α of a request
   from its task, sampling temperature and requested length (`acceptance_prior`), blends
   the prediction with the bucket's measured acceptance (a moving estimate, the prior worth
   `prior_tokens` proposed tokens), and picks the draft depth d that maximises
   E[A](d) / cost(d), with E[A](d) = (1 - α^(d+1)) / (1 - α) tokens per verify pass. A
   bucket where nothing beats 1 is off, probing every `probe_every`-th request. Requests
   asking for very few tokens do not speculate (nothing to amortise). `fixed` mode always
   returns the configured depth.

2. Adaptive plans are load-aware and carry the predicted α (`acceptance`): the target picks
   the depth per engine step from its measured step and draft times, its load and each
   sequence's α, which starts from this prediction (services/common/speculation_cost.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from services.common.speculation_cost import expected_tokens
from services.common.speculation_plan import MAX_DEPTH, POLICY_MODES

# Prior acceptance rate by task (prompt-lookup / suffix drafts): copy-heavy tasks accept
# most of what is drafted, open-ended chat little (measured: benchmarks/speculation.py).
TASK_PRIOR = {"rewrite": 0.75, "code": 0.55, "summarize": 0.45, "chat": 0.2,
              # grammar drafts: forced keys, braces and quotes (services/target/structured/)
              "structured": 0.6}
SHORT_OUTPUT_TOKENS = 8  # requests asking for at most this many tokens do not speculate


@dataclass(frozen=True)
class PolicyConfig:
    mode: str  # "fixed" | "adaptive"; no default here: the setting's (services/router/settings.py)
    max_depth: int = 10
    ewma: float = 0.3  # weight of the newest request in the acceptance estimate
    min_proposed: int = 8  # requests proposing fewer draft tokens say too little to count
    prior_tokens: float = 32.0  # the prediction counts as this many proposed tokens
    verify_overhead: float = 1.05  # a verify pass with no draft tokens, in decode steps (idle batch)
    verify_cost_per_token: float = 0.04  # measured here: depth 5 ~1.27, depth 10 ~1.46 steps
    probe_every: int = 8

    def __post_init__(self) -> None:
        if self.mode not in POLICY_MODES:
            raise ValueError(f"speculation policy mode must be one of {POLICY_MODES}, got {self.mode!r}")
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH}], got {self.max_depth}")
        if not 0 < self.ewma <= 1:
            raise ValueError(f"ewma must be in (0, 1], got {self.ewma}")


@dataclass
class _BucketState:
    acceptance: float | None = None  # measured α (moving estimate)
    measured_tokens: float = 0.0  # proposed tokens behind it (decayed like the estimate)
    requests: int = 0


class SpeculationPolicy:
    """Chooses the draft depth per request; 0 means speculation off for that request."""

    def __init__(self, config: PolicyConfig, default_depth: int) -> None:
        self.config = config
        self.default_depth = default_depth
        self._buckets: dict[str, _BucketState] = {}
        self._lock = threading.Lock()

    @property
    def load_aware(self) -> bool:
        """Plans ask the target to cap the depth per step from its load (adaptive mode)."""
        return self.config.mode == "adaptive"

    def depth(self, bucket: str, max_tokens: int | None = None, temperature: float | None = None) -> int:
        return self.plan(bucket, max_tokens, temperature)[0]

    def plan(self, bucket: str, max_tokens: int | None = None,
             temperature: float | None = None) -> tuple[int, float | None]:
        """(depth, predicted acceptance rate α or None when nothing is known) for one request."""
        if self.config.mode == "fixed":
            return self.default_depth, None
        if max_tokens is not None and max_tokens <= SHORT_OUTPUT_TOKENS:
            return 0, None
        with self._lock:
            state = self._buckets.setdefault(bucket, _BucketState())
            state.requests += 1
            prior = acceptance_prior(bucket, temperature)
            if state.acceptance is None and prior is None:
                return self.default_depth, None  # nothing known yet
            alpha = _blend(prior, state, self.config.prior_tokens)
            best_depth, best_speedup = best_depth_for(alpha, self.config)
            if best_speedup > 1.0:
                return best_depth, alpha
            return (1 if state.requests % self.config.probe_every == 0 else 0), alpha

    def observe(self, bucket: str, proposed: int, accepted: int) -> None:
        """Feeds one finished request's speculation counters back."""
        if self.config.mode == "fixed" or proposed < self.config.min_proposed:
            return
        rate = min(max(accepted / proposed, 0.0), 0.999)
        with self._lock:
            state = self._buckets.setdefault(bucket, _BucketState())
            w = self.config.ewma
            if state.acceptance is None:
                state.acceptance, state.measured_tokens = rate, float(proposed)
            else:
                state.acceptance = (1 - w) * state.acceptance + w * rate
                state.measured_tokens = (1 - w) * state.measured_tokens + proposed

    def acceptance(self, bucket: str) -> float | None:
        """The measured acceptance rate of a bucket (None before any measurement)."""
        with self._lock:
            state = self._buckets.get(bucket)
            return None if state is None else state.acceptance


def acceptance_prior(bucket: str, temperature: float | None = None) -> float | None:
    """Predicted α from the bucket's task and the sampling temperature (None: unknown task).

    Buckets are `task-length-mode` (services/router/buckets.py). Sampling lowers acceptance:
    a deterministic draft matches a sample at temperature T less often the larger T is.
    """
    task, _, rest = bucket.partition("-")
    prior = TASK_PRIOR.get(task)
    if prior is None:
        return None
    sampled = rest.endswith("sampled") if temperature is None else temperature > 0
    if sampled:
        t = 1.0 if temperature is None else temperature
        prior *= max(0.15, 1.0 - 0.6 * min(t, 1.5))
    return prior


def best_depth_for(alpha: float, config: PolicyConfig) -> tuple[int, float]:
    """(depth, expected speedup) maximising E[A](d) / cost(d) for acceptance rate `alpha`
    on an idle target (the target's `LoadAwareDepth` lowers it under load)."""
    best = (1, 0.0)
    for d in range(1, config.max_depth + 1):
        speedup = expected_tokens(alpha, d) / (config.verify_overhead + config.verify_cost_per_token * d)
        if speedup > best[1] + 1e-9:
            best = (d, speedup)
    return best


def _blend(prior: float | None, state: _BucketState, prior_tokens: float) -> float:
    if state.acceptance is None:
        return prior
    if prior is None:
        return state.acceptance
    weight = state.measured_tokens / (state.measured_tokens + prior_tokens)
    return weight * state.acceptance + (1 - weight) * prior


def structured_method(configured: str, bucket: str) -> str:
    """The method a bucket's plan names: `structured` buckets get grammar drafts (the target
    proposes what the constraint forces, prompt lookup for the free parts) unless speculation
    is off; under the `grammar` setting the other buckets do not speculate."""
    if configured == "off":
        return "off"
    if bucket.startswith("structured-"):
        return "grammar"
    return "off" if configured == "grammar" else configured
