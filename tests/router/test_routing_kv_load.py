"""KV-aware choice under concurrency: a replica that only decodes is not busy.

A tenant's first request has streamed its first token (its prefix is cached on its replica)
and is still open when the tenant's next request arrives: kv_aware sends that one to the
same replica. The open request's prefill is done, so it loads its replica with its decode
tokens only, not its whole prompt (which made the empty replica look cheaper before).
"""

from __future__ import annotations

import asyncio
import uuid

from services.common.mesh_config import MeshConfig, PoolConfig, TenantConfig
from services.router.routing import RouteRequest
from specmesh.proto.v1 import common_pb2, target_service_pb2
from tests.mesh import request
from tests.routing_mesh import generate, prefix_match, start_cache, start_router, start_target
from tests.router.test_routing_kv import SYSTEM

AUTH = (("authorization", "Bearer tok-a"),)


async def test_a_decoding_request_does_not_push_its_tenant_off_the_replica_with_its_prefix(tiny_llama_dir):
    targets = [await start_target(tiny_llama_dir) for _ in range(2)]
    cache = await start_cache([t.address for t in targets])
    mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(tiny_llama_dir),
                                        replicas=tuple(t.address for t in targets)),),
                      tenants=(TenantConfig(name="tenant-a", token="tok-a"),))
    router = await start_router(mesh, cache.address, replica_policy="kv_aware")
    routing = router.service.routing
    pool = routing.pools["default"]
    salt = router.service.auth.salt("tenant-a")
    first_prompt = SYSTEM["a"] + "Question 1: how do I reset my device?"
    # The first request runs through the router's own Routing and stays open after its first token.
    target_request = target_service_pb2.TargetServiceGenerateRequest(
        request_id=uuid.uuid4().hex, prompt=first_prompt, tenant_salt=salt, bucket="short",
        sampling=common_pb2.SamplingParams(max_tokens=16),
        speculation=common_pb2.SpeculationPlan(method=common_pb2.SPECULATION_METHOD_OFF))
    first = RouteRequest(target_request, "tenant-a", 16)
    stream = routing.execute(await routing.decide(first), first, 60.0)
    try:
        assert (await stream.__anext__()).chunk.token_ids  # prefill done, first token out
        home = [r.address for r in pool.replicas.replicas if r.in_flight]
        assert len(home) == 1
        # Wait (bounded) until the prefix index shows the first prompt's blocks on its replica.
        hashes = pool.block_hashes((await pool.tokenize(first_prompt))[:-1], salt)
        for _ in range(1500):
            if (await prefix_match(cache.address, hashes)).get(home[0], 0) == len(hashes):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the prefix index did not catch up")
        await pool.replicas.poll_once()
        prompt_tokens = len(await pool.tokenize(SYSTEM["a"] + "Question 2: and my password?"))
        assert prompt_tokens > 3 * 16  # the cached prefix outweighs the open request's decode tokens
        _, _, last, route = await generate(
            router.stub, request(SYSTEM["a"] + "Question 2: and my password?", max_tokens=4), AUTH)
        assert route.replica == home[0]
        assert last.usage.cached_prompt_tokens >= len(hashes) * 4 - 4 * 4  # (almost) the whole system prompt
    finally:
        await stream.aclose()
        await router.stop()
        await cache.stop(grace=0.5)
        for t in targets:
            await t.stop(grace=0.5)
    assert all(r.in_flight == 0 and r.in_flight_tokens == 0 for r in pool.replicas.replicas)


async def test_a_prompt_in_flight_counts_as_cached_on_its_replica_before_the_index_hears(tiny_llama_dir):
    """No prefix index at all (no cache service): the only sign of where the tenant's prefix is
    is the first request, open on its replica. The second request of the tenant goes there
    (it starts with the blocks the first one holds), not to the idle replica — as when the
    index lags the replica's KV events (the first one still in prefill)."""
    targets = [await start_target(tiny_llama_dir) for _ in range(2)]
    mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(tiny_llama_dir),
                                        replicas=tuple(t.address for t in targets)),),
                      tenants=(TenantConfig(name="tenant-a", token="tok-a"),))
    router = await start_router(mesh, "", replica_policy="kv_aware")
    routing = router.service.routing
    pool = routing.pools["default"]
    salt = router.service.auth.salt("tenant-a")
    await pool.replicas.poll_once()  # block size known: the router can hash prompts
    target_request = target_service_pb2.TargetServiceGenerateRequest(
        request_id=uuid.uuid4().hex, prompt=SYSTEM["a"] + "Question 1: how do I reset my device?",
        tenant_salt=salt, bucket="short", sampling=common_pb2.SamplingParams(max_tokens=16),
        speculation=common_pb2.SpeculationPlan(method=common_pb2.SPECULATION_METHOD_OFF))
    first = RouteRequest(target_request, "tenant-a", 16)
    stream = routing.execute(await routing.decide(first), first, 60.0)
    try:
        assert (await stream.__anext__()).chunk.token_ids
        home = [r for r in pool.replicas.replicas if r.in_flight]
        assert len(home) == 1 and len(home[0].sent) == 1
        _, _, last, route = await generate(
            router.stub, request(SYSTEM["a"] + "Question 2: and my password?", max_tokens=4), AUTH)
        assert route.replica == home[0].address
        assert route.predicted_cached_tokens > 3 * 16 and last.usage.cached_prompt_tokens > 3 * 16
    finally:
        await stream.aclose()
        await router.stop()
        for t in targets:
            await t.stop(grace=0.5)
    assert all(not r.sent for r in pool.replicas.replicas)  # forgotten with their calls
