"""The router sends a request to the replica that can load its prefix from the shared tier:
replica A (outside the pool) computed two prompts and wrote them to Redis; the pool's replicas B
(with a shared tier) and C (without) are both idle and hold nothing of them in their pools. B's
score counts the shared-tier blocks (at their load cost), so both requests go to B and load the
prefix instead of recomputing it; without tier pricing the first would tie and go to C (the
pool lists C first)."""

from __future__ import annotations

import asyncio

import grpc

from services.common.mesh_config import MeshConfig, PoolConfig, TenantConfig
from specmesh.proto.v1 import cache_service_pb2, cache_service_pb2_grpc, common_pb2, target_service_pb2
from specmesh.proto.v1 import target_service_pb2_grpc
from tests.e2e.test_generate import hf_greedy
from tests.mesh import request
from tests.routing_mesh import generate, start_cache, start_router, start_target
from tests.target.shared_redis import URL, kv_prefix  # noqa: F401 (fixture)

AUTH = (("authorization", "Bearer tok-a"),)
# Different from their first token on: nothing of one is a prefix of the other.
PROMPTS = [f"{name} manual: the lighthouse keeper counted the ships that passed each night and wrote "
           f"their names in a book. " * 2 for name in ("Alpha", "Bravo")]


async def test_a_shared_tier_hit_draws_the_request_to_the_replica_that_can_load_it(tiny_llama_dir, kv_prefix):
    shared = dict(kv_host_bytes=1 << 24, kv_shared_url=URL, kv_shared_prefix=kv_prefix)
    a, b = await start_target(tiny_llama_dir, **shared), await start_target(tiny_llama_dir, **shared)
    c = await start_target(tiny_llama_dir)
    cache = await start_cache([a.address, b.address, c.address])
    mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(tiny_llama_dir),
                                        replicas=(c.address, b.address)),),  # a tie goes to C first
                      tenants=(TenantConfig(name="tenant-a", token="tok-a"),))
    router = await start_router(mesh, cache.address, replica_policy="kv_aware")
    salt = router.service.auth.salt("tenant-a")
    try:
        async with grpc.aio.insecure_channel(a.address) as channel:  # A computes both prompts
            for prompt in PROMPTS:
                async for _ in target_service_pb2_grpc.TargetServiceStub(channel).Generate(
                        target_service_pb2.TargetServiceGenerateRequest(
                            prompt=prompt, tenant_salt=salt, sampling=common_pb2.SamplingParams(max_tokens=2))):
                    pass
        pool = router.service.routing.pools["default"]
        await pool.replicas.poll_once()  # the replicas' block size and model id, for the hashes
        for prompt in PROMPTS:
            hashes = pool.block_hashes((await pool.tokenize(prompt))[:-1], salt)
            assert len(hashes) > 20
            await _until_shared(cache.address, hashes, b.address)
            ids, _, last, route = await generate(router.stub, request(prompt, max_tokens=8), AUTH)
            assert route.replica == b.address
            assert last.usage.shared_cached_prompt_tokens == len(hashes) * 4
            assert ids == hf_greedy(tiny_llama_dir, prompt, 8)
            await pool.replicas.poll_once()
    finally:
        await router.stop()
        await cache.stop(grace=0.5)
        for t in (a, b, c):
            await t.stop(grace=0.5)


async def _until_shared(cache_address: str, hashes: list[int], replica: str) -> None:
    """Waits (bounded) until the prefix index counts every block of `hashes` in the shared tier."""
    async with grpc.aio.insecure_channel(cache_address) as channel:
        stub = cache_service_pb2_grpc.CacheServiceStub(channel)
        for _ in range(1500):  # a bound for a loaded machine, not a timing assertion
            reply = await stub.PrefixMatch(cache_service_pb2.PrefixMatchRequest(block_hashes=hashes,
                                                                                replicas=[replica]))
            if reply.matches[0].shared_blocks == len(hashes):  # B holds none of it: all in the shared tier
                return
            await asyncio.sleep(0.02)
    raise AssertionError("the prefix index never saw the shared-tier blocks")
