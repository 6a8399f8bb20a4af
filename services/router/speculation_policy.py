"""Speculation plans (DESIGN sections 1 and 5): per bucket at the router, per step at the target.

Two halves, one module, so the words and the cost model are defined once:

1. `SpeculationPolicy` (router, per request). Predicts the acceptance rate α of a request
   from its task, sampling temperature and requested length (`acceptance_prior`), blends
   the prediction with the bucket's measured acceptance (a moving estimate, the prior worth
   `prior_tokens` proposed tokens), and picks the draft depth d that maximises
   E[A](d) / cost(d), with E[A](d) = (1 - α^(d+1)) / (1 - α) tokens per verify pass. A
   bucket where nothing beats 1 is off, probing every `probe_every`-th request. Requests
   asking for very few tokens do not speculate (nothing to amortise). `fixed` mode always
   returns the configured depth.

2. `LoadAwareDepth` (target, per engine step; used when the plan says `load_aware`).
   Speculation spends idle compute: with a small batch a verify pass of d+1 tokens per
   sequence costs about as much as a decode step, with a large one it costs d+1 times
   more. The target measures its step time as a function of the tokens in the step
   (`StepCostModel`, t(n) = a + b·n, fitted online) and the draft call time, and picks
   the depth that maximises the batch's committed tokens per second — d = 0 (no
   speculation) when the batch is large — from each sequence's own measured α.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# Prior acceptance rate by task (prompt-lookup / suffix drafts): copy-heavy tasks accept
# most of what is drafted, open-ended chat little (measured: benchmarks/speculation.py).
TASK_PRIOR = {"rewrite": 0.75, "code": 0.55, "summarize": 0.45, "chat": 0.2}
SHORT_OUTPUT_TOKENS = 8  # requests asking for at most this many tokens do not speculate


@dataclass(frozen=True)
class PolicyConfig:
    mode: str = "fixed"  # "fixed" | "adaptive"
    max_depth: int = 10
    ewma: float = 0.3  # weight of the newest request in the acceptance estimate
    min_proposed: int = 8  # requests proposing fewer draft tokens say too little to count
    prior_tokens: float = 32.0  # the prediction counts as this many proposed tokens
    verify_overhead: float = 1.05  # a verify pass with no draft tokens, in decode steps (idle batch)
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
        if self.config.mode == "fixed":
            return self.default_depth
        if max_tokens is not None and max_tokens <= SHORT_OUTPUT_TOKENS:
            return 0
        with self._lock:
            state = self._buckets.setdefault(bucket, _BucketState())
            state.requests += 1
            prior = acceptance_prior(bucket, temperature)
            if state.acceptance is None and prior is None:
                return self.default_depth  # nothing known yet
            alpha = _blend(prior, state, self.config.prior_tokens)
            best_depth, best_speedup = best_depth_for(alpha, self.config)
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


def expected_tokens(alpha: float, depth: int) -> float:
    """E[A](d): accepted + bonus tokens per verify pass of a chain of `depth` draft tokens."""
    alpha = min(max(alpha, 0.0), 0.999)
    return (1 - alpha ** (depth + 1)) / (1 - alpha)


# ---- target side: per-step depth from measured times and load ---------------------------
class StepCostModel:
    """Engine step time as a function of the tokens it computes: t(n) ≈ a + b·n.

    Fitted online by exponentially weighted least squares (`decay` per step), so it follows
    the machine as it is now (other load, thermal state). Not thread-safe: the engine thread
    owns it.
    """

    def __init__(self, decay: float = 0.98, min_steps: int = 16) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.steps = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1
        self._n = d * self._n + num_tokens
        self._t = d * self._t + seconds
        self._nn = d * self._nn + num_tokens * num_tokens
        self._nt = d * self._nt + num_tokens * seconds
        self.steps += 1

    @property
    def ready(self) -> bool:
        return self.steps >= self.min_steps and self.coefficients() is not None

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds per token; None while the steps do not vary in size."""
        if self._w == 0:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var <= 1e-9:
            return None
        b = max((self._nt / self._w - mean_n * mean_t) / var, 0.0)
        return max(mean_t - b * mean_n, 0.0), b

    def predict(self, num_tokens: float) -> float:
        a, b = self.coefficients() or (0.0, 0.0)
        return a + b * num_tokens


class LoadAwareDepth:
    """Per engine step: the draft depth that maximises committed tokens per second.

    `choose(plain_tokens, plain_outputs, alphas, max_depths)`:
    - plain_tokens: tokens the step computes for sequences that do not speculate (prefill
      chunks, plain decodes); plain_outputs: tokens those commit (decodes only);
    - alphas / max_depths: each speculation candidate's acceptance estimate and plan limit.
    Returns one depth for every candidate (0 = decode normally this step).
    """

    def __init__(self, cost: StepCostModel | None = None, ewma: float = 0.2, min_alpha: float = 0.05,
                 margin: float = 1.05) -> None:
        self.cost = cost or StepCostModel()
        self.draft_seconds: float | None = None  # moving mean of one batched draft call
        self.ewma = ewma
        self.min_alpha = min_alpha
        self.margin = margin  # speculation must beat plain decoding by this factor (model error)

    def observe_draft(self, seconds: float) -> None:
        w = self.ewma
        self.draft_seconds = seconds if self.draft_seconds is None else (1 - w) * self.draft_seconds + w * seconds

    def choose(self, plain_tokens: int, plain_outputs: int, alphas: list[float],
               max_depths: list[int]) -> int:
        """The common depth for all candidates (each still capped by its own max depth)."""
        if not alphas:
            return 0
        if not self.cost.ready:
            return max(max_depths)  # not measured yet: the plan as asked
        n = len(alphas)
        best_depth, best_rate = 0, (plain_outputs + n) / max(self.cost.predict(plain_tokens + n), 1e-9)
        draft = self.draft_seconds or 0.0
        for d in range(1, max(max_depths) + 1):
            depths = [min(d, m) if a >= self.min_alpha else 0 for a, m in zip(alphas, max_depths)]
            tokens = plain_tokens + sum(1 + k for k in depths)
            committed = plain_outputs + sum(expected_tokens(a, k) if k else 1.0 for a, k in zip(alphas, depths))
            rate = committed / max(self.cost.predict(tokens) + draft, 1e-9)
            if rate > best_rate * (self.margin if best_depth == 0 else 1.0001):
                best_depth, best_rate = d, rate
        return best_depth


def sequence_alpha(proposed: int, accepted: int, prior: float = 0.3, prior_tokens: float = 2.0) -> float:
    """A sequence's acceptance estimate: its own counts, with a weak prior (one pass of
    rejected drafts is enough to stop a sequence that does not accept)."""
    return (accepted + prior * prior_tokens) / (proposed + prior_tokens)


def _blend(prior: float | None, state: _BucketState, prior_tokens: float) -> float:
    if state.acceptance is None:
        return prior
    if prior is None:
        return state.acceptance
    weight = state.measured_tokens / (state.measured_tokens + prior_tokens)
    return weight * state.acceptance + (1 - weight) * prior
