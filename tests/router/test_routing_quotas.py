"""Tenant quotas at the router and tenant priority at the target.

An over-quota tenant gets RESOURCE_EXHAUSTED with a retry-pushback hint while another
tenant is served; under a full target a high-priority tenant's request is admitted before
queued low-priority ones (the priority travels from the mesh config to the scheduler)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.mesh_config import MeshConfig, PoolConfig, TenantConfig
from specmesh.proto.v1 import target_service_pb2, target_service_pb2_grpc
from services.router.quotas import QuotaExceeded, TenantQuotas
from tests.mesh import request
from tests.routing_mesh import generate, start_router, start_target

A, B = (("authorization", "Bearer tok-a"),), (("authorization", "Bearer tok-b"),)


def test_token_bucket_and_concurrency_with_a_fake_clock():
    now = [0.0]
    quotas = TenantQuotas((TenantConfig(name="a", token="x", max_concurrent=2, tokens_per_second=100,
                                        burst_tokens=300),), clock=lambda: now[0])
    release_1 = quotas.acquire("a", 200)
    with pytest.raises(QuotaExceeded) as info:  # 100 left, 150 asked: 0.5 s until enough
        quotas.acquire("a", 150)
    assert info.value.retry_after_ms == 500
    release_2 = quotas.acquire("a", 100)
    with pytest.raises(QuotaExceeded, match="2 requests in flight") as info:
        quotas.acquire("a", 1)
    assert info.value.retry_after_ms == 100
    release_1()
    release_1()  # idempotent
    now[0] = 3.0  # refilled to the burst size
    release_3 = quotas.acquire("a", 1000)  # above the burst: admitted on a full bucket, leaves debt
    assert quotas.in_flight("a") == 2
    release_2()
    with pytest.raises(QuotaExceeded, match="tokens/s") as info:
        quotas.acquire("a", 1)  # 300 - 1000 = -700 tokens: 7.01 s until one is available
    assert info.value.retry_after_ms == 7010
    release_3()
    assert quotas.acquire("unknown-tenant", 10**9) is not None  # tenants without limits pass


async def test_over_quota_tenant_is_refused_while_another_is_served(tiny_llama_dir):
    target = await start_target(tiny_llama_dir)
    mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(tiny_llama_dir), replicas=(target.address,)),),
                      tenants=(TenantConfig(name="a", token="tok-a", max_concurrent=1),
                               TenantConfig(name="b", token="tok-b")))
    router = await start_router(mesh)
    try:
        long_call = router.stub.Generate(request("a long story", max_tokens=200), metadata=A)
        first = await long_call.read()  # tenant a now has one request in flight
        assert first.chunk.token_ids
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(router.stub, request("another", max_tokens=4), A)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == "100"
        ids, _, _, _ = await generate(router.stub, request("tenant b is served", max_tokens=4), B)
        assert len(ids) == 4
        while await long_call.read() != grpc.aio.EOF:
            pass
        ids, _, _, _ = await generate(router.stub, request("again", max_tokens=4), A)  # slot freed
        assert len(ids) == 4
    finally:
        await router.stop()
        await target.stop(grace=0.2)


async def test_high_priority_tenant_is_admitted_before_queued_low_priority(tiny_llama_dir):
    target = await start_target(tiny_llama_dir, max_num_seqs=1)  # one running: the rest queue
    mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(tiny_llama_dir), replicas=(target.address,)),),
                      tenants=(TenantConfig(name="low", token="tok-a", priority=0),
                               TenantConfig(name="high", token="tok-b", priority=5)))
    router = await start_router(mesh)
    stats = target_service_pb2_grpc.TargetServiceStub(grpc.aio.insecure_channel(target.address))
    finished: list[str] = []

    async def run(name, auth, max_tokens):
        await generate(router.stub, request(f"request {name}", max_tokens=max_tokens), auth)
        finished.append(name)

    async def waiting(n):
        for _ in range(3000):  # a bound for a loaded machine, not a timing assertion
            if (await stats.GetStats(target_service_pb2.GetStatsRequest())).waiting_requests == n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never {n} waiting")
    try:
        busy = router.stub.Generate(request("busy", max_tokens=120), metadata=A)
        await busy.read()  # running, holding the only slot
        tasks = [asyncio.ensure_future(run("low-1", A, 4))]
        await waiting(1)
        tasks.append(asyncio.ensure_future(run("low-2", A, 4)))
        await waiting(2)
        tasks.append(asyncio.ensure_future(run("high", B, 4)))
        await waiting(3)
        while await busy.read() != grpc.aio.EOF:
            pass
        await asyncio.gather(*tasks)
        assert finished == ["high", "low-1", "low-2"]
    finally:
        await router.stop()
        await target.stop(grace=0.2)
