"""Retrieval and tool result caches behind one aiocache backend.

`ResultCache` owns the backend connection. Keys are `<namespace>:<kind>:<key>`, so the
kinds (`retrieval`, `tool`) are separate namespaces and several deployments can share
one Redis. Values are raw bytes, stored as they are (no serialization).
"""

from __future__ import annotations

import asyncio

from aiocache import Cache
from aiocache.serializers import NullSerializer
from redis.exceptions import RedisError

from services.cache.config import CacheConfig

KINDS = ("retrieval", "tool")


class BackendUnavailable(Exception):
    """The cache backend (Redis) did not answer; the message says which and why."""


class ResultCache:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._cache = _make_backend(config)

    async def get(self, kind: str, key: str) -> bytes | None:
        """The stored value, or None on a miss or after expiry."""
        value = await self._call("get", self._key(kind, key))
        return None if value is None else bytes(value)

    async def put(self, kind: str, key: str, value: bytes, ttl_seconds: int) -> None:
        """Stores `value` for `ttl_seconds` (> 0), replacing any earlier value."""
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        await self._call("set", self._key(kind, key), bytes(value), ttl=int(ttl_seconds))

    async def delete(self, kind: str, key: str) -> None:
        await self._call("delete", self._key(kind, key))

    async def close(self) -> None:
        try:
            await self._cache.close()
        except (RedisError, OSError):
            pass  # closing a connection to a dead Redis has nothing left to do

    # ---- helpers ------------------------------------------------------------------------

    def _key(self, kind: str, key: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"unknown cache kind {kind!r}; expected one of {KINDS}")
        return f"{self.config.namespace}:{kind}:{key}"

    async def _call(self, operation: str, *args, **kwargs):
        try:
            return await getattr(self._cache, operation)(*args, **kwargs)
        except asyncio.TimeoutError:  # aiocache's own timeout (an OSError in 3.11, checked first)
            raise BackendUnavailable(f"{self._where()} did not answer {operation} within "
                                     f"{self.config.backend_timeout_seconds:g}s") from None
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(f"{self._where()} failed on {operation}: "
                                     f"{type(exc).__name__}: {exc}") from None

    def _where(self) -> str:
        endpoint = self.config.redis_endpoint
        return "memory cache" if endpoint is None else f"redis at {endpoint.host}:{endpoint.port}"


def _make_backend(config: CacheConfig):
    # NullSerializer with encoding None: bytes go in and come back unchanged on both backends.
    common = dict(serializer=NullSerializer(encoding=None), timeout=config.backend_timeout_seconds)
    endpoint = config.redis_endpoint
    if endpoint is None:
        return Cache(Cache.MEMORY, **common)
    return Cache(Cache.REDIS, endpoint=endpoint.host, port=endpoint.port, db=endpoint.db,
                 password=endpoint.password, ssl=endpoint.ssl,
                 create_connection_timeout=config.backend_timeout_seconds, **common)
