"""Confidence escalation: a low-confidence cheap pool's answer is discarded and the request
runs on its `escalate_to` pool (the client sees only that answer, equal to the big pool's own
greedy answer); a confident one is kept; a failing cheap pool falls back. Metrics count all."""

from __future__ import annotations

from services.common.mesh_config import MeshConfig, PoolConfig, TenantConfig
from services.router import route_metrics
from tests.mesh import request
from tests.processes import free_port
from tests.routing_mesh import generate, start_router, start_target
from tests.e2e.test_generate import hf_greedy

AUTH = (("authorization", "Bearer tok"),)
PROMPT = "Once upon a time"
BUCKET = "chat-short-greedy"


async def test_low_confidence_escalates_confident_does_not(tiny_llama_dir, tiny_gemma_dir):
    cheap, big = await start_target(tiny_llama_dir), await start_target(tiny_gemma_dir)
    common = dict(model=str(tiny_llama_dir), replicas=(cheap.address,), escalate_to="big",
                  escalate_buckets=("chat-*",))
    mesh = MeshConfig(pools=(
        # A random tiny model is far below a mean log-prob of -0.5 per token: it escalates.
        PoolConfig(name="unsure", min_mean_logprob=-0.5, **common),
        PoolConfig(name="sure", min_mean_logprob=-100.0, **common),  # a threshold it always meets
        PoolConfig(name="down", replicas=(f"127.0.0.1:{free_port()}",), model=str(tiny_llama_dir),
                   escalate_to="big"),
        PoolConfig(name="big", model=str(tiny_gemma_dir), replicas=(big.address,))),
        tenants=(TenantConfig(name="t", token="tok"),))
    router = await start_router(mesh)
    metric = {"specmesh.bucket": BUCKET}
    before = {name: route_metrics.count(name, **metric) for name in
              (route_metrics.CANDIDATES, route_metrics.UPGRADES, route_metrics.FALLBACKS)}

    async def run(model):
        req = request(PROMPT, max_tokens=12)
        req.model = model
        return await generate(router.stub, req, AUTH)
    try:
        big_ids, big_text, _, big_route = await run("big")
        assert big_ids == hf_greedy(tiny_gemma_dir, PROMPT, 12)
        assert not big_route.escalated

        ids, text, last, route = await run("unsure")
        assert (ids, text) == (big_ids, big_text)  # only the big pool's answer reached the client
        assert (route.pool, route.escalated, route.escalated_from, route.replica) == \
            ("big", True, "unsure", big.address)

        ids, _, last, route = await run("sure")
        assert ids == hf_greedy(tiny_llama_dir, PROMPT, 12)
        assert (route.pool, route.escalated) == ("sure", False)
        assert last.usage.min_logprob <= last.usage.mean_logprob < -0.5  # the signal it was judged by
        assert last.usage.mean_margin >= 0

        ids, _, _, route = await run("down")  # the cheap pool has no live replica: fallback
        assert ids == big_ids and (route.pool, route.escalated_from) == ("big", "down")

        after = {name: route_metrics.count(name, **metric) for name in before}
        assert after[route_metrics.CANDIDATES] - before[route_metrics.CANDIDATES] == 3  # unsure, sure, down
        assert after[route_metrics.UPGRADES] - before[route_metrics.UPGRADES] == 1
        assert after[route_metrics.FALLBACKS] - before[route_metrics.FALLBACKS] == 1
    finally:
        await router.stop()
        await cheap.stop(grace=0.2)
        await big.stop(grace=0.2)
