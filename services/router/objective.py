"""Pool choice: m* = argmin over pools of λ1·cost + λ2·latency − λ3·quality + λ4·risk.

Pure functions over what the router knows about each pool for one request (`PoolView`),
so the choice is table-testable. Terms:
- cost: the pool's prices × the request's prompt tokens and max_tokens (per 1,000).
- latency_s: (work queued on the chosen replica + uncached prompt tokens) / prefill speed
  + max_tokens × the pool's measured time per output token.
- quality: the pool's prior for the request's bucket, in [0, 1].
- risk: the sum of the matching risk rules' penalties for the pool.

Before the objective: a pool whose `max_context` is below prompt + max_tokens is never
chosen (length pools), a matching risk rule with `force_pool` decides, else an explicit
`model` names the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.mesh_config import PoolConfig, RiskRule, Weights


class NoPool(ValueError):
    """No pool can serve the request (maps to INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class PoolView:
    config: PoolConfig
    prompt_tokens: int  # the prompt in this pool's tokenizer
    cached_tokens: int = 0  # leading prompt tokens the best replica holds
    queued_tokens: int = 0  # work ahead of the request on that replica
    tpot_s: float | None = None  # measured time per output token; None = the config's prior
    available: bool = True  # has a healthy replica; unavailable pools lose to any available one


@dataclass(frozen=True)
class Score:
    cost: float
    latency_s: float
    quality: float
    risk: float
    total: float


@dataclass(frozen=True)
class PoolChoice:
    pool: PoolConfig
    score: Score
    reason: str  # "objective" | "model" | "risk:<rule>"
    scores: dict[str, Score]  # every eligible pool's terms


def score(view: PoolView, max_tokens: int, bucket: str, risk: float, weights: Weights) -> Score:
    pool = view.config
    cost = (view.prompt_tokens * pool.price_prompt_per_1k + max_tokens * pool.price_completion_per_1k) / 1000
    uncached = max(0, view.prompt_tokens - view.cached_tokens)
    tpot = pool.tpot_s if view.tpot_s is None else view.tpot_s
    latency = (view.queued_tokens + uncached) / pool.prefill_tokens_per_s + max_tokens * tpot
    quality = pool.quality_for(bucket)
    total = weights.cost * cost + weights.latency * latency - weights.quality * quality + weights.risk * risk
    return Score(cost, latency, quality, risk, total)


def choose_pool(views: list[PoolView], *, prompt: str, max_tokens: int, bucket: str, weights: Weights,
                rules: tuple[RiskRule, ...] = (), tenant_flags: tuple[str, ...] = (),
                model: str = "") -> PoolChoice:
    """Raises NoPool when `model` is unknown or too short for the request, or nothing fits."""
    known = {v.config.name for v in views}
    if model and model not in known:
        raise NoPool(f"unknown model pool {model!r}; known pools: {sorted(known)}")
    eligible = [v for v in views if fits(v, max_tokens)]
    risks = {v.config.name: 0.0 for v in views}
    forced: tuple[str, str] | None = None  # (pool, rule)
    for rule in rules:
        if rule.matches(prompt, tenant_flags):
            for pool, penalty in rule.penalty.items():
                risks[pool] = risks.get(pool, 0.0) + penalty
            if rule.force_pool and forced is None:
                forced = (rule.force_pool, rule.name)
    scores = {v.config.name: score(v, max_tokens, bucket, risks[v.config.name], weights) for v in eligible}
    if forced is not None:
        return _named(views, scores, forced[0], f"risk:{forced[1]}", max_tokens)
    if model:
        return _named(views, scores, model, "model", max_tokens)
    if not eligible:
        longest = max(views, key=lambda v: v.config.max_context or math.inf)
        raise NoPool(f"prompt ({longest.prompt_tokens} tokens) plus max_tokens ({max_tokens}) fits "
                     f"no pool's context limit")
    best = min(eligible, key=lambda v: (not v.available, scores[v.config.name].total, v.config.name))
    return PoolChoice(best.config, scores[best.config.name], "objective", scores)


def fits(view: PoolView, max_tokens: int) -> bool:
    limit = view.config.max_context
    return limit == 0 or view.prompt_tokens + max_tokens <= limit


def _named(views: list[PoolView], scores: dict[str, Score], name: str, reason: str,
           max_tokens: int) -> PoolChoice:
    view = next(v for v in views if v.config.name == name)
    if name not in scores:
        raise NoPool(f"prompt ({view.prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
                     f"pool {name!r}'s context limit of {view.config.max_context} tokens")
    return PoolChoice(view.config, scores[name], reason, scores)
