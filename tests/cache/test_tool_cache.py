"""Tool-result cache with single-flight leases: real cache servers on loopback, real Redis."""

from __future__ import annotations

import asyncio
import subprocess
import uuid

import grpc
import pytest
import redis.asyncio as aioredis

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.cache.identity import caller_metadata
from specmesh.proto.v1 import cache_service_pb2 as pb
from specmesh.proto.v1 import cache_service_pb2_grpc
from tests.processes import free_port

REDIS_URL = "redis://127.0.0.1:6379/0"
HIT, LEASE, WAITED = (pb.TOOL_LOOKUP_OUTCOME_HIT, pb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED,
                      pb.TOOL_LOOKUP_OUTCOME_WAITED)
A, B = caller_metadata("tenant-a"), caller_metadata("tenant-b")


class Instance:
    """One started cache server and a stub."""

    def __init__(self, **config) -> None:
        self.server = build_cache_server(CacheConfig(**config))

    async def __aenter__(self) -> Instance:
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = cache_service_pb2_grpc.CacheServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(0)

    @property
    def waiting(self) -> int:
        return self.server.service.tools.waiting

    async def lookup(self, tool="weather", args='{"city": "Paris"}', version="1", metadata=A, **kw):
        return await self.stub.ToolLookup(pb.ToolLookupRequest(
            tool=tool, tool_version=version, arguments_json=args, **kw), metadata=metadata)

    async def store(self, lease_id, tool="weather", args='{"city": "Paris"}', version="1",
                    metadata=A, **result):
        await self.stub.ToolStore(pb.ToolStoreRequest(
            tool=tool, tool_version=version, arguments_json=args, lease_id=lease_id, **result),
            metadata=metadata)


@pytest.fixture
async def namespace():
    name = f"specmesh-test-{uuid.uuid4().hex}"
    yield name
    client = aioredis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{name}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def redis_keys(namespace: str) -> list[bytes]:
    client = aioredis.from_url(REDIS_URL)
    try:
        return sorted([key async for key in client.scan_iter(match=f"{namespace}:*")])
    finally:
        await client.aclose()


async def until(condition, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def expect_status(call, code, text: str | None = None) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    if text is not None:
        assert text in info.value.details(), info.value.details()
    return info.value.details()


async def test_twenty_concurrent_lookups_on_two_instances_compute_once(namespace):
    shared = dict(backend="redis", redis_url=REDIS_URL, namespace=namespace)
    async with Instance(**shared) as first, Instance(**shared) as second:
        calls = [asyncio.ensure_future((first, second)[i % 2].lookup()) for i in range(20)]
        done, _ = await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
        holder = done.pop().result()
        assert holder.outcome == LEASE and holder.lease_id
        # All 19 others are waiting on the lease before the holder stores (no timing guess).
        await until(lambda: first.waiting + second.waiting == 19, "19 waiters")
        await first.store(holder.lease_id, value=b"18 degrees")  # either instance: the lease is in Redis
        replies = await asyncio.gather(*calls)
        assert sorted(r.outcome for r in replies) == [LEASE] + [WAITED] * 19
        assert [r.value for r in replies if r.outcome == WAITED] == [b"18 degrees"] * 19
        assert (await second.lookup()).outcome == HIT
        assert first.server.service.tools._stored == second.server.service.tools._stored == {}
        # The lease is released; the value lives under the tenant's namespace.
        keys = await redis_keys(namespace)
        assert len(keys) == 1 and keys[0].startswith(f"{namespace}:t:tenant-a:tool:weather:1:".encode())


async def test_expired_lease_passes_to_a_waiter_and_the_late_store_is_refused():
    async with Instance() as cache:
        first = await cache.lookup(lease_ms=200)
        assert first.outcome == LEASE
        second = await cache.lookup(lease_ms=5000)  # waits, then the expired lease passes on
        assert second.outcome == LEASE and second.lease_id != first.lease_id
        await expect_status(cache.store(first.lease_id, value=b"late"),
                            grpc.StatusCode.FAILED_PRECONDITION, "another caller holds the lease")
        await cache.store(second.lease_id, value=b"fresh")
        reply = await cache.lookup()
        assert (reply.outcome, reply.value) == (HIT, b"fresh")
        assert cache.server.service.tools._stored == {}  # no wake-up entry outlives its waiters


async def test_waiter_gives_up_at_its_deadline():
    async with Instance() as cache:
        assert (await cache.lookup()).outcome == LEASE
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await cache.stub.ToolLookup(pb.ToolLookupRequest(
                tool="weather", tool_version="1", arguments_json='{"city": "Paris"}'),
                metadata=A, timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: cache.waiting == 0, "the waiter to leave")


async def test_errors_are_cached_briefly_versions_and_tenants_are_separate():
    async with Instance(tool_error_ttl_seconds=1) as cache:
        lease = (await cache.lookup()).lease_id
        await cache.store(lease, error_message="upstream 503", ttl_seconds=300)  # capped at 1 s
        reply = await cache.lookup(args='{ "city" : "Paris" }')  # same canonical arguments
        assert (reply.outcome, reply.is_error, reply.error_message) == (HIT, True, "upstream 503")
        assert (await cache.lookup(version="2")).outcome == LEASE  # a version bump is a new key
        assert (await cache.lookup(metadata=B)).outcome == LEASE  # another tenant's key
        await asyncio.sleep(1.1)
        assert (await cache.lookup()).outcome == LEASE


BAD_LOOKUPS = {
    "empty tool": (dict(tool=""), "tool is empty"),
    "oversized tool": (dict(tool="t" * 257), "tool is above"),
    "empty version": (dict(version=""), "tool_version is empty"),
    "not JSON": (dict(args="{city: Paris}"), "not JSON"),
    "NaN": (dict(args='{"x": NaN}'), "not JSON"),
    "oversized arguments": (dict(args='"' + "x" * 70000 + '"'), "arguments_json is above"),
    "lease out of range": (dict(lease_ms=-1), "lease_ms -1"),
}


@pytest.mark.parametrize("name", list(BAD_LOOKUPS))
async def test_bad_lookup_is_invalid_argument_and_stores_nothing(namespace, name):
    fields, text = BAD_LOOKUPS[name]
    async with Instance(backend="redis", redis_url=REDIS_URL, namespace=namespace) as cache:
        await expect_status(cache.lookup(**fields), grpc.StatusCode.INVALID_ARGUMENT, text)
        store_fields = {"ttl_seconds": -1} if "lease_ms" in fields else fields  # ToolStore has no lease_ms
        await expect_status(cache.store("", value=b"v", **store_fields), grpc.StatusCode.INVALID_ARGUMENT)
        assert await redis_keys(namespace) == []
        await expect_status(cache.lookup(metadata=()), grpc.StatusCode.UNAUTHENTICATED, "specmesh-tenant")


async def test_redis_down_is_unavailable_and_service_recovers(tmp_path):
    port = free_port()

    def start_redis() -> subprocess.Popen:
        return subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                                 "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)

    redis_server = start_redis()
    try:
        async with Instance(backend="redis", redis_url=f"redis://127.0.0.1:{port}/0",
                            backend_timeout_seconds=1.0) as cache:
            await until_ok(cache)
            redis_server.terminate()
            redis_server.wait(10)
            await expect_status(cache.lookup(args='{"n": 2}'), grpc.StatusCode.UNAVAILABLE,
                                f"cache backend unavailable: redis at 127.0.0.1:{port}")
            redis_server = start_redis()
            await until_ok(cache, args='{"n": 3}')
    finally:
        redis_server.terminate()
        redis_server.wait(10)


async def until_ok(cache: Instance, args: str = '{"n": 1}') -> None:
    """Retries until Redis answers (it takes a moment to start); then a lease is granted."""
    for _ in range(100):
        try:
            reply = await cache.lookup(args=args)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            await asyncio.sleep(0.05)
            continue
        assert reply.outcome == LEASE
        return
    raise AssertionError("redis did not come back")
