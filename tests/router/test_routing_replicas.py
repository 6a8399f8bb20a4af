"""Replica health: a killed replica is ejected, a request that had not streamed yet is
retried on the other and completes, and the replica rejoins after a restart."""

from __future__ import annotations

import asyncio

from services.common.mesh_config import MeshConfig, PoolConfig, TenantConfig
from tests.mesh import request
from tests.routing_mesh import generate, start_router, start_target

AUTH = (("authorization", "Bearer tok"),)


async def test_killed_replica_retry_and_rejoin(tiny_llama_dir):
    first, second = await start_target(tiny_llama_dir), await start_target(tiny_llama_dir)
    port = first.port
    mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(tiny_llama_dir),
                                        replicas=(first.address, second.address)),),
                      tenants=(TenantConfig(name="t", token="tok"),))
    # round_robin makes the replica of each request predictable; health polls only when asked.
    router = await start_router(mesh, replica_policy="round_robin")
    replicas = router.service.routing.pools["default"].replicas
    restarted = None
    try:
        expected, _, _, route = await generate(router.stub, request("hello there", 8), AUTH)
        assert route.replica == first.address and not route.retried
        _, _, _, route = await generate(router.stub, request("hello there", 8), AUTH)
        assert route.replica == second.address

        await first.stop(grace=0.2)  # the router has not noticed: its next turn is `first`
        ids, _, last, route = await generate(router.stub, request("hello there", 8), AUTH)
        assert (route.replica, route.retried) == (second.address, True)  # retried before a token
        assert ids == expected and last.usage.completion_tokens == 8
        assert [r.address for r in replicas.healthy()] == [second.address]  # ejected at once
        for _ in range(3):  # new requests go to the other replica only
            _, _, _, route = await generate(router.stub, request("hello there", 8), AUTH)
            assert (route.replica, route.retried) == (second.address, False)

        restarted = await start_target(tiny_llama_dir, port=port)  # same address
        for _ in range(100):  # the periodic health check (the channel reconnects within its backoff)
            await replicas.poll_once()
            if len(replicas.healthy()) == 2:
                break
            await asyncio.sleep(0.1)
        assert {r.address for r in replicas.healthy()} == {first.address, second.address}
        served = set()
        for _ in range(2):
            ids, _, _, route = await generate(router.stub, request("hello there", 8), AUTH)
            served.add(route.replica)
            assert ids == expected
        assert served == {first.address, second.address}  # rejoined
    finally:
        await router.stop()
        for server in (second, restarted):
            if server is not None:
                await server.stop(grace=0.2)


async def test_all_replicas_down_is_unavailable(tiny_llama_dir):
    import grpc
    import pytest

    from tests.processes import free_port
    mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(tiny_llama_dir),
                                        replicas=(f"127.0.0.1:{free_port()}",)),),
                      tenants=(TenantConfig(name="t", token="tok"),))
    router = await start_router(mesh)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(router.stub, request("hello", 4), AUTH)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy replica" in info.value.details()
    finally:
        await router.stop()


async def test_overlapping_checks_of_a_slow_replica_count_as_one_failure():
    """A burst of requests ending during one slow spell refreshes the replica once per spell:
    before checks were shared, each refresh counted as a consecutive failure, and one busy
    moment ejected the only replica (the router then answered UNAVAILABLE to everyone)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.router.replicas import Replica

    class SlowHealth(health_pb2_grpc.HealthServicer):
        calls = 0

        async def Check(self, request, context):
            SlowHealth.calls += 1
            await asyncio.sleep(0.5)
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(SlowHealth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    replica = Replica(f"127.0.0.1:{port}", channel)
    try:
        results = await asyncio.gather(*(replica.check(0.1, eject_after=3) for _ in range(5)))
        assert results == [False] * 5 and SlowHealth.calls == 1
        assert (replica.failed_checks, replica.healthy) == (1, True)  # one slow spell, not five
        for _ in range(2):  # consecutive slow checks still eject
            await replica.check(0.1, eject_after=3)
        assert (replica.failed_checks, replica.healthy, SlowHealth.calls) == (3, False, 3)
    finally:
        replica.cancel_check()
        await channel.close()
        await server.stop(grace=None)
