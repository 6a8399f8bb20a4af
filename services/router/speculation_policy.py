"""Speculation plans at the router, per request: which method, how deep.

1. `SpeculationPolicy` (router, per request). Predicts the acceptance rate α of a request
   from its task, sampling temperature and requested length (`acceptance_prior`), blends
   the prediction with the measured acceptance of its (pool, bucket, method) (a moving
   estimate, the prior worth `prior_tokens` proposed tokens), and picks the draft depth d
   that maximises E[A](d) / cost(d), with E[A](d) = (1 - α^(d+1)) / (1 - α) tokens per
   verify pass. A bucket where nothing beats 1 is off, probing every `probe_every`-th
   request. Requests asking for very few tokens do not speculate (nothing to amortise).
   `fixed` mode always returns the configured depth.

2. The method per pool and bucket (`SpeculationPolicy.choose`): the candidates are the mesh's
   mapping's (services/router/speculation_methods.py; one method forced for every bucket by
   `--speculation-method X`). One candidate is planned as it is. Among several:
   - the best is the candidate with the highest estimated α, the earlier in the mapping on a
     tie or where nothing is known: a measured candidate's estimate is its measurement
     alone, an unmeasured one's its prior blended with what was measured so far (as for the
     depth; the blend would keep a method measured at 0 near its prior for good, the moving
     estimate's weight being bounded);
   - explore: while a candidate other than the best has fewer than `explore_samples`
     measurements, every `explore_every`-th request of the (pool, bucket) runs such
     candidates in turn (round robin among them), at depth >= 1 even where the prediction
     says off, so that it gets measured; every other request runs the best.
   Every finished request feeds its (pool, bucket, method) back (`observe`, in both modes),
   so a chosen method that degrades below another's estimate loses its place. A request
   whose method drafted nothing at all while its steps fell back (the draft service cannot
   serve it: an eagle plan without a head) counts as that many proposed tokens, none accepted.

3. Adaptive plans are load-aware and carry the predicted α (`acceptance`): the target picks
   the depth per engine step from its measured step and draft times, its load and each
   sequence's α, which starts from this prediction (services/common/speculation_cost.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from services.common.mesh_config import DEFAULT_POOL
from services.common.speculation_cost import expected_tokens
from services.common.speculation_plan import MAX_DEPTH, POLICY_MODES
from services.router.speculation_methods import MethodMap

# Prior acceptance rate by task (prompt-lookup / suffix drafts): copy-heavy tasks accept
# most of what is drafted, open-ended chat little (measured: benchmarks/speculation.py).
TASK_PRIOR = {"rewrite": 0.75, "code": 0.55, "summarize": 0.45, "chat": 0.2,
              # grammar drafts: forced keys, braces and quotes (services/target/structured/)
              "structured": 0.6}
# Methods whose drafts guess the target's own text rather than copy the context: one prior
# whatever the task. eagle: issue 26's goal, accepted length 2.0 at depth 4 (α ≈ 0.5).
METHOD_PRIOR = {"eagle": 0.5}
SHORT_OUTPUT_TOKENS = 8  # requests asking for at most this many tokens do not speculate
DEFAULT_METHOD = "prompt_lookup"  # a policy built without a mapping plans this (and grammar drafts)


@dataclass(frozen=True)
class PolicyConfig:
    mode: str  # "fixed" | "adaptive"; no default here: the setting's (services/router/settings.py)
    max_depth: int = 10
    ewma: float = 0.3  # weight of the newest request in the acceptance estimate
    min_proposed: int = 8  # requests proposing fewer draft tokens say too little to count alone
    prior_tokens: float = 32.0  # the prediction counts as this many proposed tokens
    verify_overhead: float = 1.05  # a verify pass with no draft tokens, in decode steps (idle batch)
    verify_cost_per_token: float = 0.04  # measured here: depth 5 ~1.27, depth 10 ~1.46 steps
    probe_every: int = 8
    # Method choice: a candidate measured fewer times than this (requests, or pooled small
    # ones, of at least `min_proposed` tokens) is explored on every `explore_every`-th request
    # of its (pool, bucket) (a quarter of them by default). More than one look: suffix decoding,
    # for one, drafts from the outputs it saw before and accepts more the second time.
    explore_samples: int = 3
    explore_every: int = 4

    def __post_init__(self) -> None:
        if self.mode not in POLICY_MODES:
            raise ValueError(f"speculation policy mode must be one of {POLICY_MODES}, got {self.mode!r}")
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH}], got {self.max_depth}")
        if not 0 < self.ewma <= 1:
            raise ValueError(f"ewma must be in (0, 1], got {self.ewma}")
        if self.explore_every < 1 or self.explore_samples < 1:
            raise ValueError(f"explore_every and explore_samples must be >= 1, got "
                             f"{self.explore_every}, {self.explore_samples}")


@dataclass
class _BucketState:
    """One (pool, bucket, method)'s measurement."""

    acceptance: float | None = None  # measured α (moving estimate)
    measured_tokens: float = 0.0  # proposed tokens behind it (decayed like the estimate)
    requests: int = 0
    samples: int = 0  # measurements folded into the estimate
    pending_proposed: int = 0  # small requests' counters, not yet enough to count
    pending_accepted: int = 0


@dataclass(frozen=True)
class MethodPlan:
    """What `SpeculationPolicy.choose` decided for one request."""

    method: str  # "off" when the request does not speculate
    depth: int  # 0 = off
    acceptance: float | None  # predicted α, None when nothing is known
    choice: str  # why this method: "only" (one candidate), "best" (highest estimate), "explore"


class SpeculationPolicy:
    """Chooses the method and draft depth per request; depth 0 means speculation off.

    The one owner of the router's speculation measurements: per (pool, bucket, method)."""

    def __init__(self, config: PolicyConfig, default_depth: int, methods: MethodMap | None = None) -> None:
        self.config = config
        self.default_depth = default_depth
        self.methods = methods or MethodMap.forced(DEFAULT_METHOD)
        self._buckets: dict[tuple[str, str, str], _BucketState] = {}
        self._planned: dict[tuple[str, str], int] = {}  # requests with a choice, per (pool, bucket)
        self._lock = threading.Lock()

    @property
    def load_aware(self) -> bool:
        """Plans ask the target to cap the depth per step from its load (adaptive mode)."""
        return self.config.mode == "adaptive"

    def depth(self, bucket: str, max_tokens: int | None = None, temperature: float | None = None) -> int:
        return self.plan(bucket, max_tokens, temperature)[0]

    def plan(self, bucket: str, max_tokens: int | None = None,
             temperature: float | None = None) -> tuple[int, float | None]:
        """(depth, predicted acceptance rate α or None when nothing is known) for one request
        of the default pool."""
        chosen = self.choose(bucket, max_tokens, temperature)
        return chosen.depth, chosen.acceptance

    def choose(self, bucket: str, max_tokens: int | None = None, temperature: float | None = None,
               pool: str = DEFAULT_POOL) -> MethodPlan:
        """The method (the module docstring's rule) and its depth for one request on `pool`."""
        candidates = self.methods.candidates(pool, bucket)
        if candidates == ("off",):
            return MethodPlan("off", 0, None, "only")
        if self.config.mode == "adaptive" and max_tokens is not None and max_tokens <= SHORT_OUTPUT_TOKENS:
            return MethodPlan("off", 0, None, "only")
        with self._lock:
            method, choice = self._method(pool, bucket, candidates, temperature)
            if self.config.mode == "fixed":
                return MethodPlan(method, self.default_depth, None, choice)
            depth, alpha = self._depth(self._state(pool, bucket, method), bucket, method, temperature)
            if choice == "explore":
                depth = max(depth, 1)  # measured even where the prediction says off
            if method == "grammar":
                # The bucket's acceptance mixes the grammar's forced drafts (nearly always
                # accepted) with the free parts' prompt-lookup drafts; the target prices each
                # kind by its own per step, so the plan's depth only caps the forced chains:
                # the configured depth, never what the mix predicts (at T = 0.8 that was 2).
                depth = max(depth, self.default_depth)
            return MethodPlan(method if depth else "off", depth, alpha, choice)

    def _method(self, pool: str, bucket: str, candidates: tuple[str, ...],
                temperature: float | None) -> tuple[str, str]:
        if len(candidates) == 1:
            return candidates[0], "only"
        key = (pool, bucket)
        n = self._planned[key] = self._planned.get(key, 0) + 1
        unmeasured = [m for m in candidates
                      if self._state(pool, bucket, m).samples < self.config.explore_samples]

        def estimate(method: str) -> float:
            state = self._state(pool, bucket, method)
            if method not in unmeasured:
                return state.acceptance  # measured enough: the measurement alone speaks
            alpha = _blend(acceptance_prior(bucket, temperature, method), state, self.config.prior_tokens)
            return -1.0 if alpha is None else alpha
        best = max(candidates, key=lambda m: (estimate(m), -candidates.index(m)))
        others = [m for m in unmeasured if m != best]  # the best gets measured as it runs
        if others and n % self.config.explore_every == 0:
            return others[(n // self.config.explore_every) % len(others)], "explore"
        return best, "best"

    def _depth(self, state: _BucketState, bucket: str, method: str,
               temperature: float | None) -> tuple[int, float | None]:
        state.requests += 1
        prior = acceptance_prior(bucket, temperature, method)
        if state.acceptance is None and prior is None:
            return self.default_depth, None  # nothing known yet
        alpha = _blend(prior, state, self.config.prior_tokens)
        best_depth, best_speedup = best_depth_for(alpha, self.config)
        if best_speedup > 1.0:
            return best_depth, alpha
        return (1 if state.requests % self.config.probe_every == 0 else 0), alpha

    def _state(self, pool: str, bucket: str, method: str) -> _BucketState:
        return self._buckets.setdefault((pool, bucket, method), _BucketState())

    def observe(self, bucket: str, proposed: int, accepted: int, method: str | None = None,
                pool: str = DEFAULT_POOL, fallback_steps: int = 0) -> None:
        """Feeds one finished request's speculation counters back (its route record's pool and
        plan method; None = the bucket's first candidate). Requests proposing fewer than
        `min_proposed` tokens are pooled until together they do. Steps that fell back count
        only when the method drafted nothing at all (the module docstring)."""
        if proposed == 0 and fallback_steps > 0:
            proposed = fallback_steps  # a method the draft service could not serve
        method = method or self.methods.candidates(pool, bucket)[0]
        if proposed <= 0 or method == "off":
            return
        with self._lock:
            state = self._state(pool, bucket, method)
            state.pending_proposed += proposed
            state.pending_accepted += accepted
            if state.pending_proposed < self.config.min_proposed:
                return
            proposed, accepted = state.pending_proposed, state.pending_accepted
            state.pending_proposed = state.pending_accepted = 0
            rate = min(max(accepted / proposed, 0.0), 0.999)
            w = self.config.ewma
            state.samples += 1
            if state.acceptance is None:
                state.acceptance, state.measured_tokens = rate, float(proposed)
            else:
                state.acceptance = (1 - w) * state.acceptance + w * rate
                state.measured_tokens = (1 - w) * state.measured_tokens + proposed

    def acceptance(self, bucket: str, method: str | None = None, pool: str = DEFAULT_POOL) -> float | None:
        """The measured acceptance rate of a bucket's method on a pool (None before any
        measurement; method None = the bucket's first candidate)."""
        method = method or self.methods.candidates(pool, bucket)[0]
        with self._lock:
            state = self._buckets.get((pool, bucket, method))
            return None if state is None else state.acceptance


def acceptance_prior(bucket: str, temperature: float | None = None,
                     method: str = DEFAULT_METHOD) -> float | None:
    """Predicted α of `method` from the bucket's task and the sampling temperature (None:
    unknown task for a method whose prior depends on it).

    Buckets are `task-length-mode` (services/router/buckets.py). Sampling lowers acceptance:
    a deterministic draft matches a sample at temperature T less often the larger T is.
    """
    task, _, rest = bucket.partition("-")
    prior = METHOD_PRIOR.get(method, TASK_PRIOR.get(task))
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


def _blend(prior: float | None, state: _BucketState, prior_tokens: float) -> float | None:
    if state.acceptance is None:
        return prior
    if prior is None:
        return state.acceptance
    weight = state.measured_tokens / (state.measured_tokens + prior_tokens)
    return weight * state.acceptance + (1 - weight) * prior


def structured_method(configured: str, bucket: str) -> str:
    """The method a bucket's plan names under a forced method: `structured` buckets get
    grammar drafts (the target proposes what the constraint forces, prompt lookup for the free
    parts) unless speculation is off; under `grammar` the other buckets do not speculate."""
    return MethodMap.forced(configured).candidates(DEFAULT_POOL, bucket)[0]
