"""The router's tool-result cache: real cache and router servers on loopback (no target needed).

Keys are scoped by the tenant of the caller's token (never a field): two tenants with the same
tool call compute twice; concurrent callers of one tenant compute once (single flight), through
the raw RPCs and through `specmesh.client`."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.common.server import ServerConfig
from services.router.app import build_router_server
from services.router.config import RouterConfig
from specmesh.client import COMPUTED, HIT, WAITED, AsyncClient, ToolCallError
from specmesh.proto.v1 import cache_service_pb2 as cpb
from specmesh.proto.v1 import router_service_pb2 as rpb
from specmesh.proto.v1 import router_service_pb2_grpc
from tests.mesh import AUTH_A, AUTH_B, TOKEN_A, TOKEN_B

ARGS = '{"city": "Paris", "days": 3}'
SAME_ARGS = '{ "days": 3, "city": "Paris" }'  # canonical JSON: the same key


async def _router(cache_address: str):
    router = build_router_server(ServerConfig(port=0), RouterConfig(
        target_address="127.0.0.1:1", tokens={TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"},
        speculation_method="off", cache_address=cache_address))
    await router.start()
    return router


@pytest.fixture
async def router():
    cache = build_cache_server(CacheConfig())
    await cache.start()
    server = await _router(cache.address)
    try:
        yield server
    finally:
        await server.stop(0)
        await cache.stop(0)


def _lookup(args: str = ARGS, tool: str = "weather") -> rpb.LookupToolResultRequest:
    return rpb.LookupToolResultRequest(tool=tool, tool_version="1", arguments_json=args)


async def test_single_flight_per_tenant_and_tenants_never_share(router):
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_service_pb2_grpc.RouterServiceStub(channel)
        first = await stub.LookupToolResult(_lookup(), metadata=AUTH_A, timeout=10)
        assert first.outcome == cpb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED and first.lease_id
        waiter = asyncio.ensure_future(stub.LookupToolResult(_lookup(SAME_ARGS), metadata=AUTH_A, timeout=10))
        other = await stub.LookupToolResult(_lookup(), metadata=AUTH_B, timeout=10)  # its own key: no waiting
        assert other.outcome == cpb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED
        await asyncio.sleep(0.05)
        assert not waiter.done()  # tenant A's second caller waits for the lease holder
        await stub.StoreToolResult(rpb.StoreToolResultRequest(tool="weather", tool_version="1", arguments_json=ARGS,
                                                  lease_id=first.lease_id, value=b"sunny"), metadata=AUTH_A)
        waited = await waiter
        assert (waited.outcome, waited.value) == (cpb.TOOL_LOOKUP_OUTCOME_WAITED, b"sunny")
        await stub.StoreToolResult(rpb.StoreToolResultRequest(tool="weather", tool_version="1", arguments_json=ARGS,
                                                  lease_id=other.lease_id, value=b"rain"), metadata=AUTH_B)
        hit_a = await stub.LookupToolResult(_lookup(), metadata=AUTH_A)
        hit_b = await stub.LookupToolResult(_lookup(), metadata=AUTH_B)
        assert (hit_a.outcome, hit_a.value) == (cpb.TOOL_LOOKUP_OUTCOME_HIT, b"sunny")
        assert (hit_b.outcome, hit_b.value) == (cpb.TOOL_LOOKUP_OUTCOME_HIT, b"rain")
        # A store by tenant B with tenant A's tool call lands on B's key; A's lease stays A's.
        again = await stub.LookupToolResult(_lookup(tool="other"), metadata=AUTH_A)
        assert again.outcome == cpb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED
        await stub.StoreToolResult(rpb.StoreToolResultRequest(tool="other", tool_version="1", arguments_json=ARGS,
                                                  lease_id=again.lease_id, value=b"forged"), metadata=AUTH_B)
        await stub.StoreToolResult(rpb.StoreToolResultRequest(tool="other", tool_version="1", arguments_json=ARGS,
                                                  lease_id=again.lease_id, value=b"real"), metadata=AUTH_A)
        assert (await stub.LookupToolResult(_lookup(tool="other"), metadata=AUTH_A)).value == b"real"
        assert (await stub.LookupToolResult(_lookup(tool="other"), metadata=AUTH_B)).value == b"forged"


async def test_client_computes_once_for_concurrent_agents(router):
    calls = []

    async def weather(arguments):
        calls.append(arguments)
        await asyncio.sleep(0.1)
        return f"sunny in {arguments['city']}"

    async with AsyncClient(router.address, token=TOKEN_A) as a1, AsyncClient(router.address, token=TOKEN_A) as a2, \
            AsyncClient(router.address, token=TOKEN_B) as b:
        args = {"city": "Paris", "days": 3}
        r1, r2 = await asyncio.gather(a1.cached_tool_call("weather", args, weather),
                                      a2.cached_tool_call("weather", args, weather))
        assert sorted([r1.outcome, r2.outcome]) == sorted([COMPUTED, WAITED])
        assert r1.value == r2.value == b"sunny in Paris" and len(calls) == 1
        assert (await a2.cached_tool_call("weather", args, weather)).outcome == HIT
        assert (await b.cached_tool_call("weather", args, weather)).outcome == COMPUTED  # tenant B's own
        assert len(calls) == 2

        def broken(arguments):
            raise RuntimeError("weather service down")
        with pytest.raises(RuntimeError):
            await a1.cached_tool_call("weather", {"city": "Oslo"}, broken)
        with pytest.raises(ToolCallError, match="weather service down"):  # cached briefly, for everyone
            await a2.cached_tool_call("weather", {"city": "Oslo"}, weather)


async def test_bad_input_and_missing_credentials(router):
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_service_pb2_grpc.RouterServiceStub(channel)
        cases = [(_lookup("{not json"), AUTH_A, grpc.StatusCode.INVALID_ARGUMENT, "arguments_json is not JSON"),
                 (_lookup(tool=""), AUTH_A, grpc.StatusCode.INVALID_ARGUMENT, "tool is empty"),
                 (rpb.LookupToolResultRequest(tool="t", tool_version="1", lease_ms=-1), AUTH_A,
                  grpc.StatusCode.INVALID_ARGUMENT, "lease_ms"),
                 (_lookup(), (), grpc.StatusCode.UNAUTHENTICATED, ""),
                 (_lookup(), (("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED, "")]
        for req, metadata, code, words in cases:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.LookupToolResult(req, metadata=metadata, timeout=10)
            assert exc.value.code() == code and words in exc.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as exc:  # neither value nor error
            await stub.StoreToolResult(rpb.StoreToolResultRequest(tool="t", tool_version="1", arguments_json="1"),
                                 metadata=AUTH_A)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = await stub.LookupToolResult(_lookup(), metadata=AUTH_A, timeout=10)  # still serving
        assert ok.outcome == cpb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED


async def test_without_a_cache_service_it_is_failed_precondition():
    server = await _router("")
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await router_service_pb2_grpc.RouterServiceStub(channel).LookupToolResult(_lookup(), metadata=AUTH_A)
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await server.stop(0)
