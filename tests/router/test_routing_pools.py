"""Pool choice by the λ objective: table-driven over `choose_pool`, then through a real router
(explicit model honoured, unknown model INVALID_ARGUMENT, length pools, risk rules)."""

from __future__ import annotations

import grpc
import pytest

from services.common.mesh_config import MeshConfig, PoolConfig, RiskRule, TenantConfig, Weights
from services.router.objective import NoPool, PoolView, choose_pool
from tests.mesh import request
from tests.routing_mesh import generate, start_router, start_target

CHEAP = PoolConfig(name="cheap", replicas=("h:1",), price_prompt_per_1k=0.1, price_completion_per_1k=0.2,
                   quality={"*": 0.4}, tpot_s=0.01)
GOOD = PoolConfig(name="good", replicas=("h:2",), price_prompt_per_1k=1.0, price_completion_per_1k=2.0,
                  quality={"code-*": 0.95, "*": 0.8}, tpot_s=0.03)
SHORT = PoolConfig(name="short", replicas=("h:3",), max_context=600, quality={"*": 0.4}, tpot_s=0.01)
RULES = (RiskRule(name="ssn", pattern=r"\d{3}-\d{2}-\d{4}", force_pool="good"),
         RiskRule(name="regulated", tenant_flag="regulated", penalty={"cheap": 5.0}))


def _views(prompt_tokens: int, *pools):
    return [PoolView(p, prompt_tokens) for p in pools]


# (case, pools, prompt, prompt tokens, max_tokens, bucket, weights, flags, model, expected pool, reason)
CASES = [
    ("cost-heavy weights pick the cheaper pool", (CHEAP, GOOD), "hi", 100, 100, "chat-short-greedy",
     Weights(cost=100, latency=0, quality=1, risk=1), (), "", "cheap", "objective"),
    ("quality-heavy weights pick the better pool", (CHEAP, GOOD), "hi", 100, 100, "chat-short-greedy",
     Weights(cost=100, latency=0, quality=1000, risk=1), (), "", "good", "objective"),
    ("latency-heavy weights pick the faster pool", (CHEAP, GOOD), "hi", 100, 100, "chat-short-greedy",
     Weights(cost=0, latency=10, quality=1, risk=0), (), "", "cheap", "objective"),
    ("quality prior per bucket", (CHEAP, GOOD), "hi", 100, 100, "code-short-greedy",
     Weights(cost=1, latency=0, quality=1, risk=0), (), "", "good", "objective"),
    ("a risk rule forces its pool", (CHEAP, GOOD), "my ssn is 123-45-6789", 100, 100, "chat-short-greedy",
     Weights(cost=100, latency=0, quality=0, risk=0), (), "", "good", "risk:ssn"),
    ("a risk rule forces its pool over an explicit model", (CHEAP, GOOD), "ssn 123-45-6789", 100, 100,
     "chat-short-greedy", Weights(), (), "cheap", "good", "risk:ssn"),
    ("tenant-flag risk penalty moves the request", (CHEAP, GOOD), "hi", 100, 100, "chat-short-greedy",
     Weights(cost=1, latency=0, quality=0, risk=1), ("regulated",), "", "good", "objective"),
    ("without the flag the penalty does not apply", (CHEAP, GOOD), "hi", 100, 100, "chat-short-greedy",
     Weights(cost=1, latency=0, quality=0, risk=1), (), "", "cheap", "objective"),
    ("explicit model is honoured", (CHEAP, GOOD), "hi", 100, 100, "chat-short-greedy",
     Weights(cost=100, latency=0, quality=0, risk=0), (), "good", "good", "model"),
    ("a short prompt may use the length pool", (SHORT, GOOD), "hi", 400, 100, "chat-short-greedy",
     Weights(cost=1, latency=1, quality=0, risk=0), (), "", "short", "objective"),
    ("a prompt over the length limit never goes there", (SHORT, GOOD), "hi", 550, 100, "chat-long-greedy",
     Weights(cost=0, latency=1000, quality=0, risk=0), (), "", "good", "objective"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pool_choice_table(case):
    _, pools, prompt, tokens, max_tokens, bucket, weights, flags, model, expected, reason = case
    choice = choose_pool(_views(tokens, *pools), prompt=prompt, max_tokens=max_tokens, bucket=bucket,
                         weights=weights, rules=RULES, tenant_flags=flags, model=model)
    assert (choice.pool.name, choice.reason) == (expected, reason)


def test_score_terms_are_exact():
    choice = choose_pool([PoolView(CHEAP, 1000, cached_tokens=200, queued_tokens=600)], prompt="hi",
                         max_tokens=100, bucket="chat-short-greedy", weights=Weights(1, 2, 3, 4))
    s = choice.score
    assert s.cost == pytest.approx((1000 * 0.1 + 100 * 0.2) / 1000)  # 0.12
    assert s.latency_s == pytest.approx((600 + 800) / 2000.0 + 100 * 0.01)  # 1.7
    assert (s.quality, s.risk) == (0.4, 0.0)
    assert s.total == pytest.approx(0.12 + 2 * 1.7 - 3 * 0.4)


@pytest.mark.parametrize("model, tokens, message", [
    ("nope", 10, "unknown model pool 'nope'"),
    ("short", 550, "exceeds pool 'short''s context limit of 600"),
])
def test_unknown_or_too_short_model_is_refused(model, tokens, message):
    with pytest.raises(NoPool, match=message):
        choose_pool(_views(tokens, SHORT, GOOD), prompt="hi", max_tokens=100, bucket="chat-short-greedy",
                    weights=Weights(), model=model)


def test_nothing_fits():
    with pytest.raises(NoPool, match="fits no pool"):
        choose_pool(_views(700, SHORT), prompt="hi", max_tokens=100, bucket="b", weights=Weights())


async def test_pool_choice_through_the_router(tiny_llama_dir, spans):
    target = await start_target(tiny_llama_dir)
    replicas = (target.address,)  # pools are names over replicas; one replica serves both here
    mesh = MeshConfig(
        pools=(PoolConfig(name="small", model=str(tiny_llama_dir), replicas=replicas, max_context=64,
                          price_prompt_per_1k=0.1, quality={"*": 0.5}),
               PoolConfig(name="big", model=str(tiny_llama_dir), replicas=replicas, max_context=512,
                          price_prompt_per_1k=1.0, quality={"*": 0.9})),
        tenants=(TenantConfig(name="saver", token="tok-saver", tenant_class="frugal"),
                 TenantConfig(name="picky", token="tok-picky", tenant_class="quality")),
        classes={"frugal": Weights(cost=1000, latency=0, quality=1, risk=0),
                 "quality": Weights(cost=1, latency=0, quality=1000, risk=0)},
        risk_rules=(RiskRule(name="secret", pattern="TOP SECRET", force_pool="big"),))
    router = await start_router(mesh)
    saver, picky = (("authorization", "Bearer tok-saver"),), (("authorization", "Bearer tok-picky"),)
    try:
        async def route_of(prompt, auth, max_tokens=4, model=""):
            req = request(prompt, max_tokens)
            req.model = model
            return (await generate(router.stub, req, auth))[3]

        route = await route_of("hello", saver)
        assert route.pool == "small"  # λ per tenant class
        route_span = next(s for s in spans.get_finished_spans() if s.name == "route")
        attributes = dict(route_span.attributes)
        assert (attributes["specmesh.pool"], attributes["specmesh.route.reason"]) == ("small", "objective")
        assert attributes["specmesh.route.total"] == pytest.approx(route.score.total)
        assert attributes["specmesh.bucket"] == route.bucket
        assert (await route_of("hello", picky)).pool == "big"
        route = await route_of("hello", saver, model="big")
        assert (route.pool, route.reason) == ("big", "model")
        assert (await route_of("TOP SECRET plan", saver)).reason == "risk:secret"
        assert (await route_of("word " * 40, saver)).pool == "big"  # over small's 64-token limit
        route = await route_of("hello", saver)
        assert route.bucket == "chat-short-greedy" and route.replica == target.address
        assert route.score.cost == pytest.approx(route.score.total / 1000 + route.score.quality / 1000, rel=1e-6)
        for model in ("nope", "small"):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await route_of("word " * 40, saver, model=model)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await router.stop()
        await target.stop(grace=0.2)
