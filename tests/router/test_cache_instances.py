"""The router's cache service found by DNS (`cache_address: dns:///NAME:PORT`): real cache
servers on loopback addresses of their own (127.0.0.21-23, one port), each with its own name
and the shared "headless Service" name in /etc/hosts (lines this test writes and removes).

Both instances behind the name are used, each tool-result key and corpus on one instance
(the same from every router), an instance gone from DNS is dropped within a poll and its keys
move while the mesh keeps answering, a new one takes its share; a failed instance's keys go
elsewhere at once; with no instance resolved the cache features answer UNAVAILABLE and the
router keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from contextlib import AsyncExitStack

import grpc
import pytest

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.cache.tool_cache import tool_key
from services.common.server import ServerConfig
from services.router.app import build_router_server
from services.router.cache_instances import CacheInstances, cache_entries, shard_key
from services.router.config import RouterConfig
from services.router.tool_results import tool_shard_key
from specmesh.proto.v1 import cache_service_pb2 as cpb
from specmesh.proto.v1 import router_service_pb2 as rpb
from specmesh.proto.v1 import router_service_pb2_grpc
from tests.mesh import AUTH_A, TOKEN_A
from tests.netns import Hosts

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="writes /etc/hosts (needs root)")
DOMAIN = "cache-dns.specmesh.test"
POOL = f"caches.{DOMAIN}"  # the "headless Service": every cache instance's address
ADDRESSES = ("127.0.0.21", "127.0.0.22", "127.0.0.23")
NAMES = tuple(f"cache-{i}.{DOMAIN}" for i in range(3))
PERIOD_S = 0.5  # the router's poll (DNS re-resolution and health checks)
TENANT = "tenant-a"
CALLS = 24  # tool calls spread over the instances


def _free_port() -> int:
    """A port free on every one of ADDRESSES (a headless Service's pods share one port)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((ADDRESSES[0], 0))
            port = probe.getsockname()[1]
        try:
            for address in ADDRESSES:
                with socket.socket() as other:
                    other.bind((address, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every test address")


async def _router(stack: AsyncExitStack, cache_address: str, poll_interval_s: float = PERIOD_S):
    router = build_router_server(ServerConfig(port=0), RouterConfig(
        target_address="127.0.0.1:1", tokens={TOKEN_A: TENANT}, speculation_method="off",
        cache_address=cache_address, poll_interval_s=poll_interval_s))
    await router.start()
    stack.push_async_callback(router.stop, 0)
    channel = grpc.aio.insecure_channel(router.address)
    stack.push_async_callback(channel.close)
    return router, router_service_pb2_grpc.RouterServiceStub(channel)


async def _until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        await asyncio.sleep(0.05)


def _args(i: int) -> str:
    return json.dumps({"n": i, "city": "Paris"})


def _lookup(i: int, spelled_otherwise: bool = False) -> rpb.LookupToolResultRequest:
    args = json.dumps({"city": "Paris", "n": i}, indent=1) if spelled_otherwise else _args(i)
    return rpb.LookupToolResultRequest(tool="weather", tool_version="1", arguments_json=args)


async def _compute(stub, i: int) -> None:
    """Lookup -> lease -> store, through the router."""
    leased = await stub.LookupToolResult(_lookup(i), metadata=AUTH_A, timeout=10)
    assert leased.outcome == cpb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED
    await stub.StoreToolResult(rpb.StoreToolResultRequest(
        tool="weather", tool_version="1", arguments_json=_args(i), lease_id=leased.lease_id,
        value=f"sunny {i}".encode()), metadata=AUTH_A, timeout=10)


async def _holders(servers, i: int) -> list[int]:
    """Which cache servers hold tool call i's value (read from their backends)."""
    key = tool_key(CacheConfig(), TENANT, "weather", "1", _args(i)).storage_key("specmesh")
    return [n for n, server in enumerate(servers)
            if server is not None and await server.service.backend.get(key) is not None]


async def _owner(cache: CacheInstances, i: int) -> str:
    return (await cache.owner(tool_shard_key(TENANT, "weather", "1", _args(i)))).name


async def test_cache_instances_found_by_dns_share_the_keys_and_follow_dns():
    port = _free_port()
    keys = [f"{name}:{port}" for name in NAMES]
    async with AsyncExitStack() as stack:
        hosts = stack.enter_context(Hosts())
        servers = []
        for address, name in zip(ADDRESSES, NAMES):
            hosts.add(address, name)  # the instance's own name first: its reverse name
            server = build_cache_server(CacheConfig(server=ServerConfig(host=address, port=port)))
            await server.start()
            stack.push_async_callback(server.stop, 0)
            servers.append(server)
        hosts.add(ADDRESSES[0], POOL)
        hosts.add(ADDRESSES[1], POOL)
        router, stub = await _router(stack, f"dns:///{POOL}:{port}")
        cache = router.service.cache
        assert sorted(i.name for i in cache.instances) == keys[:2]  # by their own names

        # Both instances used; each call's value on exactly the instance that owns its key.
        for i in range(CALLS):
            await _compute(stub, i)
        owners = {i: await _owner(cache, i) for i in range(CALLS)}
        for i in range(CALLS):
            assert await _holders(servers, i) == [keys.index(owners[i])]
        assert set(owners.values()) == set(keys[:2])
        # Stable: the same key (however its arguments are spelled) finds its value again, and so
        # does another router resolving the same name (the shard is the same in every process).
        other, other_stub = await _router(stack, f"dns:///{POOL}:{port}")
        for i in range(CALLS):
            for s in (stub, other_stub):
                hit = await s.LookupToolResult(_lookup(i, spelled_otherwise=True), metadata=AUTH_A, timeout=10)
                assert (hit.outcome, hit.value) == (cpb.TOOL_LOOKUP_OUTCOME_HIT, f"sunny {i}".encode())
        # A corpus meets itself: a second ingest and a removal reach the instance of the first.
        for corpus in ("kb", "faq", "wiki", "notes"):
            for version, ids in ((1, ["d1"]), (2, ["d2"])):
                reply = await stub.IngestDocuments(rpb.IngestDocumentsRequest(
                    corpus=corpus, documents=[cpb.Document(id=d, text=f"text of {d}") for d in ids]),
                    metadata=AUTH_A, timeout=10)
                assert (reply.corpus_version, reply.num_documents) == (version, version)
            removed = await other_stub.RemoveDocuments(rpb.RemoveDocumentsRequest(corpus=corpus, ids=["d1"]),
                                                       metadata=AUTH_A, timeout=10)
            assert (removed.corpus_version, removed.removed) == (3, 1)

        # Scale in: an instance gone from DNS is dropped within a poll (then it stops); the
        # mesh answers every call, the keys of the survivor stay, the dropped one's move to it.
        hosts.remove(ADDRESSES[1], POOL)
        await _until(lambda: [i.name for i in cache.instances] == keys[:1], 6 * PERIOD_S)
        await servers[1].stop(0)
        servers[1] = None
        for i in range(CALLS):
            reply = await stub.LookupToolResult(_lookup(i), metadata=AUTH_A, timeout=10)
            if owners[i] == keys[0]:
                assert (reply.outcome, reply.value) == (cpb.TOOL_LOOKUP_OUTCOME_HIT, f"sunny {i}".encode())
            else:  # moved: computed again there
                assert reply.outcome == cpb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED
                await stub.StoreToolResult(rpb.StoreToolResultRequest(
                    tool="weather", tool_version="1", arguments_json=_args(i), lease_id=reply.lease_id,
                    value=f"sunny {i}".encode()), metadata=AUTH_A, timeout=10)
            assert await _holders(servers, i) == [0]

        # Scale out: a new instance in DNS is called within a poll and takes only its own keys.
        hosts.add(ADDRESSES[2], POOL)
        await _until(lambda: sorted(i.name for i in cache.instances) == [keys[0], keys[2]], 6 * PERIOD_S)
        now = {i: await _owner(cache, i) for i in range(CALLS)}
        moved = [i for i in range(CALLS) if now[i] == keys[2]]
        assert moved and all(now[i] == keys[0] for i in range(CALLS) if i not in moved)
        for i in range(CALLS):
            reply = await stub.LookupToolResult(_lookup(i), metadata=AUTH_A, timeout=10)
            if i in moved:  # computed again on the new instance
                assert reply.outcome == cpb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED
                await stub.StoreToolResult(rpb.StoreToolResultRequest(
                    tool="weather", tool_version="1", arguments_json=_args(i), lease_id=reply.lease_id,
                    value=f"sunny {i}".encode()), metadata=AUTH_A, timeout=10)
            else:
                assert reply.outcome == cpb.TOOL_LOOKUP_OUTCOME_HIT
            assert await _holders(servers, i) == ([0, 2] if i in moved else [0])  # (0 keeps its old copy)
    assert DOMAIN not in open("/etc/hosts").read()  # the machine is left clean


async def test_a_failed_instance_gives_its_keys_away_at_once():
    """An instance that stops answering (still in DNS, no poll due) fails one call with
    UNAVAILABLE; the next call of its key goes to the other instance."""
    port = _free_port()
    keys = [f"{name}:{port}" for name in NAMES[:2]]
    async with AsyncExitStack() as stack:
        hosts = stack.enter_context(Hosts())
        servers = []
        for address, name in zip(ADDRESSES[:2], NAMES[:2]):
            hosts.add(address, name)
            server = build_cache_server(CacheConfig(server=ServerConfig(host=address, port=port)))
            await server.start()
            stack.push_async_callback(server.stop, 0)
            servers.append(server)
        for address in ADDRESSES[:2]:
            hosts.add(address, POOL)
        router, stub = await _router(stack, f"dns:///{POOL}:{port}", poll_interval_s=60.0)
        cache = router.service.cache
        await cache.start()
        owners = [await _owner(cache, i) for i in range(CALLS)]
        i = owners.index(keys[1])
        await _compute(stub, i)  # instance 1 answers (and its first health check is long done)
        assert await _holders(servers, i) == [1]
        await servers[1].stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.LookupToolResult(_lookup(i), metadata=AUTH_A, timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "cache service unavailable" in exc.value.details()
        assert await _owner(cache, i) == keys[0]
        reply = await stub.LookupToolResult(_lookup(i), metadata=AUTH_A, timeout=10)
        assert reply.outcome == cpb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED
    assert DOMAIN not in open("/etc/hosts").read()


async def test_no_instance_resolved_degrades_the_cache_features_only():
    """A cache name that resolves to nothing: tool results and retrieval answer UNAVAILABLE
    naming the entry, prefix lookups nothing, and the router still serves."""
    entry = f"dns:///nothing.{DOMAIN}:50054"
    async with AsyncExitStack() as stack:
        router, stub = await _router(stack, entry)
        for call in (stub.LookupToolResult(_lookup(0), metadata=AUTH_A, timeout=10),
                     stub.IngestDocuments(rpb.IngestDocumentsRequest(corpus="kb", documents=[
                         cpb.Document(id="d", text="t")]), metadata=AUTH_A, timeout=10)):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"{entry} resolved to none" in exc.value.details()
        replicas = router.service.routing.pools["default"].replicas.replicas
        assert await router.service.routing.prefix.cached_tokens([1, 2], replicas, 4) == {}
        assert (await stub.ListModels(rpb.ListModelsRequest(), metadata=AUTH_A, timeout=10)).pools


def test_cache_address_forms():
    assert cache_entries("") == ()
    assert cache_entries(" a:1, dns:///b.c:2 ,a:1") == ("a:1", "dns:///b.c:2")
    with pytest.raises(ValueError, match="is not dns:///NAME:PORT"):
        RouterConfig(target_address="a:1", tokens={"t": "x"}, cache_address="a:1,dns:///b.c")
    assert shard_key("tool", "t", "a") != shard_key("tool", "t\0a")  # parts never run together
    assert tool_shard_key("t", "w", "1", '{"b": 1, "a": 2}') == tool_shard_key("t", "w", "1", '{"a":2,"b":1}')

