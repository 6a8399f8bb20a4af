"""The cache service as the router calls it: one instance, a list, or instances found by DNS.

`cache_address` is one entry or a comma-separated list of them; an entry `dns:///NAME:PORT`
(a Kubernetes headless Service) is resolved by services/common/dns_replicas.py, the resolver
the target pools use: each resolved pod is one instance, named by its own DNS name (the
channel target, so the pod's certificate is checked against that name). The set is
re-resolved every `poll_interval_s` (the router's replica poll) and at once when a call to an
instance fails with UNAVAILABLE; each poll also health-checks every instance. An instance
gone from DNS is dropped (its channel closes once its calls finish); a new one is called
from the next request on.

Each call goes to the instance that owns its key, by rendezvous (highest random weight)
hashing over the instances' names: the key goes to the instance with the highest
blake2b(name, key). So every router process sends a key to the same instance; while the set
is stable a key stays where it is; when an instance leaves, only its keys move (each to its
next-highest instance), and one that joins takes only the keys it now wins. The keys
(`shard_key`) are chosen so that state that must meet lands on one instance:
- prefix index: the prompt's first block hash (every instance follows every target, so any
  one answers; the key only spreads the lookups);
- retrieval: (tenant, corpus): a corpus's documents live where they were ingested (memory
  backend), so Ingest, DeleteDocuments and Retrieve of one corpus meet there;
- tool results: (tenant, tool, version, canonical arguments): the lease and the value of a
  call on one instance, so single flight holds across routers.
With the memory backend an instance that leaves takes its corpora and results with it (its
keys start empty elsewhere); with the Redis backend every instance shares them and sharding
only spreads the load.

Choice is among the healthy instances (the last health check or call succeeded), or among
all when none is (gRPC reconnects; a restarted lone instance is not left unused until the
next poll). With no instance at all (a DNS name that has not resolved yet) the call raises
`NoCacheInstance`: the router keeps serving, prefix lookups answer nothing (replica choice by
load), retrieval and tool results answer UNAVAILABLE — as when the cache is down.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import time
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.dns_replicas import DnsReplicas
from specmesh.proto.v1 import cache_service_pb2_grpc

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 2.0
CLOSE_GRACE_S = 5.0  # a dropped instance's calls in flight may finish this long


class NoCacheInstance(Exception):
    """No cache instance is known (configured by DNS, none resolved yet)."""


def cache_entries(address: str) -> tuple[str, ...]:
    """`cache_address` as entries: "" -> (); raises ValueError on a malformed dns:/// entry."""
    entries = tuple(dict.fromkeys(e.strip() for e in address.split(",") if e.strip()))
    DnsReplicas(entries)  # checks every dns:/// entry
    return entries


def shard_key(kind: str, *parts: str) -> bytes:
    """The key a call is sharded by: its kind and parts, each length-prefixed (no two part
    lists give one key, whatever bytes the parts hold)."""
    encoded = [p.encode() for p in (kind, *parts)]
    return b"".join(len(b).to_bytes(4, "big") + b for b in encoded)


def weight(name: str, key: bytes) -> int:
    """Rendezvous weight of `key` on the instance `name` (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(name.encode() + b"\0" + key, digest_size=8).digest(), "big")


class CacheInstance:
    def __init__(self, name: str, channel: grpc.aio.Channel) -> None:
        self.name = name  # HOST:PORT: its own DNS name, or the listed address
        self.channel = channel
        self.stub = cache_service_pb2_grpc.CacheServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self.healthy = True  # optimistic until a check or a call fails

    async def check(self) -> None:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=CHECK_TIMEOUT_S)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        if serving != self.healthy:
            log.info("cache instance %s %s", self.name, "rejoined" if serving else "failed its health check")
        self.healthy = serving


class CacheInstances:
    """The cache instances of one router; owns their channels, resolution and health polls."""

    def __init__(self, entries: Iterable[str], channel_factory: Callable[[str], grpc.aio.Channel],
                 poll_interval_s: float) -> None:
        self._dns = DnsReplicas(entries)
        if not self._dns.entries:
            raise ValueError("no cache address")
        self._channel_factory = channel_factory
        self.poll_interval_s = poll_interval_s
        self._instances: dict[str, CacheInstance] = {}
        self._started: asyncio.Task | None = None
        self._poll: asyncio.Task | None = None
        self._resolving: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()
        self._add(self._dns.listed())

    @classmethod
    def from_address(cls, address: str, channel_factory: Callable[[str], grpc.aio.Channel],
                     poll_interval_s: float) -> CacheInstances | None:
        """None for "" (no cache service configured)."""
        entries = cache_entries(address)
        return cls(entries, channel_factory, poll_interval_s) if entries else None

    @property
    def entries(self) -> tuple[str, ...]:
        return self._dns.entries

    @property
    def instances(self) -> list[CacheInstance]:
        return list(self._instances.values())

    async def start(self) -> None:
        """The first resolution, then the polls in the background (once; every call awaits it)."""
        if self._started is None:  # in its own context: not part of a request's trace
            self._started = asyncio.get_running_loop().create_task(self._start(), context=contextvars.Context())
        await asyncio.shield(self._started)

    async def owner(self, key: bytes) -> CacheInstance:
        """The instance `key` goes to now; NoCacheInstance when there is none."""
        await self.start()
        candidates = [i for i in self._instances.values() if i.healthy] or list(self._instances.values())
        if not candidates:
            raise NoCacheInstance(f"no cache instance: {', '.join(self.entries)} resolved to none yet")
        return max(candidates, key=lambda i: weight(i.name, key))

    async def call(self, key: bytes, method: str, request, **kwargs):
        """`CacheService.method(request)` on the owner of `key`. Raises NoCacheInstance, or the
        instance's AioRpcError; UNAVAILABLE marks the instance failed (its keys go to the next
        instance until a health check passes) and resolves the DNS entries again now."""
        instance = await self.owner(key)
        try:
            return await getattr(instance.stub, method)(request, **kwargs)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._failed(instance)
            raise

    async def close(self) -> None:
        for task in [self._started, self._poll, self._resolving]:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*self._closing, *(i.channel.close() for i in self._instances.values()),
                             return_exceptions=True)

    # ---- helpers ---------------------------------------------------------------
    async def _start(self) -> None:
        await self._resolve()
        self._poll = asyncio.get_running_loop().create_task(self._poll_forever(), context=contextvars.Context())

    async def _poll_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self._resolve()
                await asyncio.gather(*(i.check() for i in list(self._instances.values())))
            except Exception:  # never let the poller die
                log.exception("cache instance poll failed")
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    def _failed(self, instance: CacheInstance) -> None:
        if instance.healthy:
            log.warning("cache instance %s unavailable: its keys go elsewhere until it answers", instance.name)
        instance.healthy = False
        if self._dns.dynamic and (self._resolving is None or self._resolving.done()):
            self._resolving = asyncio.get_running_loop().create_task(self._resolve(), context=contextvars.Context())

    async def _resolve(self) -> None:
        """Expands the dns:/// entries; adds new instances, drops vanished ones."""
        added, removed = await self._dns.changes(self._instances.keys())
        for name in added:
            log.info("cache instance %s found by DNS", name)
        self._add(added)
        for name in removed:
            log.info("cache instance %s left DNS: dropped", name)
            closing = asyncio.get_running_loop().create_task(
                self._instances.pop(name).channel.close(grace=CLOSE_GRACE_S), context=contextvars.Context())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _add(self, names) -> None:
        for name in names:
            self._instances[name] = CacheInstance(name, self._channel_factory(name))

