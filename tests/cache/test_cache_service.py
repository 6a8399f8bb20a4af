"""CacheService Get/Put over real gRPC on loopback, with the memory backend and a real Redis.

Every call carries the tenant metadata the router sets (services/cache/identity.py)."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig, RedisEndpoint
from services.cache.identity import caller_metadata
from specmesh.proto.v1 import cache_service_pb2 as pb
from specmesh.proto.v1 import cache_service_pb2_grpc
from tests.processes import free_port

REDIS_URL = "redis://127.0.0.1:6379/0"
RETRIEVAL, TOOL = pb.CACHE_KIND_RETRIEVAL, pb.CACHE_KIND_TOOL
INVALID = grpc.StatusCode.INVALID_ARGUMENT


class _AsTenant(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, tenant: str | None) -> None:
        self.metadata = caller_metadata(tenant) if tenant else ()

    async def intercept_unary_unary(self, continuation, details, request):
        details = details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *self.metadata))
        return await continuation(details, request)


class Client:
    """A started cache server and a stub talking to it as `tenant`."""

    def __init__(self, config: CacheConfig, tenant: str | None = "tenant-a", server=None) -> None:
        self.server = server or build_cache_server(config)
        self.owns_server = server is None
        self.tenant = tenant
        self.channel = None
        self.stub = None

    async def __aenter__(self) -> Client:
        if self.owns_server:
            await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.server.address, interceptors=[_AsTenant(self.tenant)])
        self.stub = cache_service_pb2_grpc.CacheServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        if self.owns_server:
            await self.server.stop(0)

    async def put(self, kind, key, value: bytes, ttl: int = 60):
        await self.stub.Put(pb.CacheServicePutRequest(kind=kind, key=key, value=value, ttl_seconds=ttl))

    async def get(self, kind, key) -> bytes | None:
        response = await self.stub.Get(pb.CacheServiceGetRequest(kind=kind, key=key))
        return response.value if response.found else None


@pytest.fixture
async def redis_namespace():
    """A namespace unique to this test; its keys are deleted afterwards."""
    namespace = f"specmesh-test-{uuid.uuid4().hex}"
    yield namespace
    client = aioredis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{namespace}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def cache(request, redis_namespace):
    if request.param == "memory":
        config = CacheConfig(max_value_bytes=1024)
    else:
        config = CacheConfig(backend="redis", redis_url=REDIS_URL, namespace=redis_namespace,
                             max_value_bytes=1024)
    async with Client(config) as client:
        yield client


async def expect_status(call, code, text: str | None = None) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    if text is not None:
        assert text in info.value.details()
    return info.value.details()


# ---- behaviour on both backends ---------------------------------------------------------------

async def test_round_trip_and_miss(cache):
    value = bytes(range(256)) + b"\x00tail"
    await cache.put(TOOL, "weather(Paris)", value)
    assert await cache.get(TOOL, "weather(Paris)") == value
    assert await cache.get(TOOL, "weather(Rome)") is None
    await cache.put(TOOL, "weather(Paris)", b"")  # overwrite; an empty value is a hit
    response = await cache.stub.Get(pb.CacheServiceGetRequest(kind=TOOL, key="weather(Paris)"))
    assert response.found and response.value == b""


async def test_kinds_are_separate_namespaces(cache):
    await cache.put(RETRIEVAL, "q", b"documents")
    assert await cache.get(TOOL, "q") is None
    await cache.put(TOOL, "q", b"tool result")
    assert await cache.get(RETRIEVAL, "q") == b"documents"
    assert await cache.get(TOOL, "q") == b"tool result"


async def test_ttl_expiry(cache):
    await cache.put(RETRIEVAL, "short", b"x", ttl=1)
    await cache.put(RETRIEVAL, "long", b"y", ttl=60)
    assert await cache.get(RETRIEVAL, "short") == b"x"
    await asyncio.sleep(1.2)
    assert await cache.get(RETRIEVAL, "short") is None
    assert await cache.get(RETRIEVAL, "long") == b"y"


BAD_PUTS = {
    "empty key": (dict(kind=TOOL, key="", value=b"v", ttl_seconds=10), "key is empty"),
    "unspecified kind": (dict(kind=pb.CACHE_KIND_UNSPECIFIED, key="k", value=b"v", ttl_seconds=10),
                         "CACHE_KIND_UNSPECIFIED"),
    "unknown kind": (dict(kind=7, key="k", value=b"v", ttl_seconds=10), "got 7"),
    "zero ttl": (dict(kind=TOOL, key="k", value=b"v", ttl_seconds=0), "ttl_seconds 0"),
    "negative ttl": (dict(kind=TOOL, key="k", value=b"v", ttl_seconds=-5), "ttl_seconds -5"),
    "ttl over max": (dict(kind=TOOL, key="k", value=b"v", ttl_seconds=86401), "ttl_seconds 86401"),
    "value too big": (dict(kind=TOOL, key="k", value=b"v" * 1025, ttl_seconds=10), "1025 bytes"),
    "key too long": (dict(kind=TOOL, key="k" * 1025, value=b"v", ttl_seconds=10), "key is above"),
}


@pytest.mark.parametrize("name", list(BAD_PUTS))
async def test_bad_put_is_invalid_argument_and_stores_nothing(cache, name):
    fields, text = BAD_PUTS[name]
    await expect_status(cache.stub.Put(pb.CacheServicePutRequest(**fields)), INVALID, text)
    assert await cache.get(TOOL, "k") is None
    await cache.put(TOOL, "k", b"v" * 1024, ttl=86400)  # the limits themselves are fine
    assert await cache.get(TOOL, "k") == b"v" * 1024


@pytest.mark.parametrize("kind,key,text", [(TOOL, "", "key is empty"),
                                           (pb.CACHE_KIND_UNSPECIFIED, "k", "CACHE_KIND_UNSPECIFIED")])
async def test_bad_get_is_invalid_argument(cache, kind, key, text):
    await expect_status(cache.stub.Get(pb.CacheServiceGetRequest(kind=kind, key=key)), INVALID, text)
    assert await cache.get(TOOL, "k") is None  # still serving


async def test_tenants_are_separate_and_identity_is_required(cache):
    await cache.put(TOOL, "k", b"a's value")
    async with Client(None, tenant="tenant-b", server=cache.server) as other:
        assert await other.get(TOOL, "k") is None
        await other.put(TOOL, "k", b"b's value")
    assert await cache.get(TOOL, "k") == b"a's value"
    async with Client(None, tenant=None, server=cache.server) as anonymous:
        await expect_status(anonymous.stub.Get(pb.CacheServiceGetRequest(kind=TOOL, key="k")),
                            grpc.StatusCode.UNAUTHENTICATED, "specmesh-tenant")


async def test_memory_backend_evicts_least_recently_used():
    # Each entry: key "<ns>:t:tenant-a:tool:kN" (25 bytes) + 100-byte value = 125 bytes.
    async with Client(CacheConfig(max_memory_bytes=400)) as cache:
        for name in ("k1", "k2", "k3"):
            await cache.put(TOOL, name, b"x" * 100)
        assert await cache.get(TOOL, "k1") == b"x" * 100  # k1 is now the most recently used
        await cache.put(TOOL, "k4", b"y" * 100)  # 500 > 400 bytes: evicts k2, the least recent
        assert [await cache.get(TOOL, k) is not None for k in ("k1", "k2", "k3", "k4")] \
            == [True, False, True, True]
        assert cache.server.service.backend.evictions == 1


# ---- Redis: shared between replicas, and down -------------------------------------------------

async def test_two_servers_share_redis(redis_namespace):
    config = CacheConfig(backend="redis", redis_url=REDIS_URL, namespace=redis_namespace)
    async with Client(config) as first, Client(config) as second:
        await first.put(RETRIEVAL, "doc:42", b"shared", ttl=30)
        assert await second.get(RETRIEVAL, "doc:42") == b"shared"
    client = aioredis.from_url(REDIS_URL)
    try:  # stored under <namespace>:t:<tenant>:<kind>:<key>, as raw bytes
        assert await client.get(f"{redis_namespace}:t:tenant-a:retrieval:doc:42") == b"shared"
    finally:
        await client.aclose()


async def test_redis_down_is_unavailable():
    config = CacheConfig(backend="redis", redis_url=f"redis://127.0.0.1:{free_port()}/0",
                         backend_timeout_seconds=1.0)
    async with Client(config) as cache:
        await expect_status(cache.stub.Get(pb.CacheServiceGetRequest(kind=TOOL, key="k")),
                            grpc.StatusCode.UNAVAILABLE, "cache backend unavailable")
        await expect_status(cache.stub.Put(pb.CacheServicePutRequest(kind=TOOL, key="k", value=b"v", ttl_seconds=5)),
                            grpc.StatusCode.UNAVAILABLE, "cache backend unavailable")
        # Bad input is still INVALID_ARGUMENT, checked before the backend is asked.
        await expect_status(cache.stub.Put(pb.CacheServicePutRequest(kind=TOOL, key="k", ttl_seconds=0)), INVALID)


# ---- server plumbing and config ---------------------------------------------------------------

async def test_health_serving_and_span_attributes(spans):  # `spans`: tests/conftest.py
    async with Client(CacheConfig()) as cache:
        reply = await health_pb2_grpc.HealthStub(cache.channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await cache.get(TOOL, "secret-key")
        await cache.put(TOOL, "secret-key", b"secret-value")
        await cache.get(TOOL, "secret-key")
    lookups = [s for s in spans.get_finished_spans() if s.name == "cache.lookup"]
    assert [(s.attributes["specmesh.cache_kind"], s.attributes["specmesh.cache_hit"]) for s in lookups] \
        == [("tool", False), ("tool", True)]
    for span in spans.get_finished_spans():
        for value in span.attributes.values():
            assert "secret" not in str(value)


def test_config_is_validated():
    for bad in (dict(backend="memcached"), dict(backend="redis"), dict(redis_url=REDIS_URL),
                dict(backend="redis", redis_url="http://127.0.0.1:6379"),
                dict(backend="redis", redis_url="redis://127.0.0.1:6379/zero"),
                dict(backend="redis", redis_url="redis://127.0.0.1:99999"),
                dict(namespace=""), dict(namespace="a:b"), dict(max_ttl_seconds=0),
                dict(max_value_bytes=0), dict(backend_timeout_seconds=float("nan"))):
        with pytest.raises(ValueError):
            CacheConfig(**bad)
    assert RedisEndpoint.parse("rediss://:p%40ss@cache.internal:6380/2") == RedisEndpoint(
        "cache.internal", 6380, 2, "p@ss", True)
