"""Storage behind the cache service: in memory (one process) or Redis (shared).

Two kinds of data, with different rules:
- *results* (retrieval results, tool values, leases, Get/Put values): expiring byte
  values; in memory they live in one LRU bounded by `max_memory_bytes`.
- *corpora* (documents and corpus versions): authoritative, never evicted; bounded by
  the per-corpus limits checked before ingest.

The operations are the few the caches need, each atomic on both backends: set-if-absent
with expiry (leases), compare-and-delete (lease release), and "write documents and bump
the version" as one transaction. aiocache offers neither a size bound nor
compare-and-delete, so this talks to redis-py directly.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.cache.config import CacheConfig

_DELETE_IF_EQUALS = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class BackendUnavailable(Exception):
    """The backend (Redis) did not answer; the message says which and why."""


class MemoryBackend:
    def __init__(self, max_memory_bytes: int) -> None:
        self.max_memory_bytes = max_memory_bytes
        self._values: OrderedDict[str, tuple[bytes, float | None]] = OrderedDict()  # LRU first
        self._bytes = 0
        self.evictions = 0
        self._hashes: dict[str, dict[str, bytes]] = {}
        self._ints: dict[str, int] = {}

    # ---- results ----------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        entry = self._values.get(key)
        if entry is None:
            return None
        if entry[1] is not None and entry[1] <= time.monotonic():
            self._drop(key)
            return None
        self._values.move_to_end(key)
        return entry[0]

    async def set(self, key: str, value: bytes, ttl_ms: int) -> None:
        self._drop(key)
        size = len(key) + len(value)
        if size > self.max_memory_bytes:
            return  # larger than the whole cache: not cached (the config bounds values well below)
        while self._bytes + size > self.max_memory_bytes:
            self._drop(next(iter(self._values)))
            self.evictions += 1
        self._values[key] = (bytes(value), time.monotonic() + ttl_ms / 1000)
        self._bytes += size

    async def set_nx(self, key: str, value: bytes, ttl_ms: int) -> bool:
        if await self.get(key) is not None:
            return False
        await self.set(key, value, ttl_ms)
        return True

    async def delete(self, key: str) -> None:
        self._drop(key)

    async def delete_if_equals(self, key: str, value: bytes) -> bool:
        if await self.get(key) != value:
            return False
        self._drop(key)
        return True

    # ---- corpora ----------------------------------------------------------------------------

    async def get_int(self, key: str) -> int | None:
        return self._ints.get(key)

    async def hash_update(self, hash_key: str, put: dict[str, bytes], remove: list[str],
                          version_key: str) -> tuple[int, int]:
        """Writes `put`, removes `remove`; bumps the version. Returns (version, removed)."""
        fields = self._hashes.setdefault(hash_key, {})
        removed = sum(fields.pop(f, None) is not None for f in remove)
        fields.update(put)
        self._ints[version_key] = self._ints.get(version_key, 0) + 1
        return self._ints[version_key], removed

    async def hash_read(self, hash_key: str, version_key: str) -> tuple[int | None, dict[str, bytes]]:
        """(version, all fields) read together."""
        return self._ints.get(version_key), dict(self._hashes.get(hash_key, {}))

    async def hash_count(self, hash_key: str, fields: list[str]) -> tuple[int, int]:
        """(fields in the hash, how many of `fields` are among them)."""
        held = self._hashes.get(hash_key, {})
        return len(held), sum(f in held for f in fields)

    async def close(self) -> None:
        pass

    def _drop(self, key: str) -> None:
        entry = self._values.pop(key, None)
        if entry is not None:
            self._bytes -= len(key) + len(entry[0])


class RedisBackend:
    def __init__(self, config: CacheConfig) -> None:
        e = config.redis_endpoint
        self._where = f"redis at {e.host}:{e.port}"
        self._timeout = config.backend_timeout_seconds
        self._redis = aioredis.Redis(host=e.host, port=e.port, db=e.db, password=e.password,
                                     ssl=e.ssl, socket_timeout=self._timeout,
                                     socket_connect_timeout=self._timeout)
        self._delete_if_equals = self._redis.register_script(_DELETE_IF_EQUALS)

    async def get(self, key: str) -> bytes | None:
        return await self._call("GET", self._redis.get(key))

    async def set(self, key: str, value: bytes, ttl_ms: int) -> None:
        await self._call("SET", self._redis.set(key, value, px=ttl_ms))

    async def set_nx(self, key: str, value: bytes, ttl_ms: int) -> bool:
        return bool(await self._call("SET NX", self._redis.set(key, value, px=ttl_ms, nx=True)))

    async def delete(self, key: str) -> None:
        await self._call("DEL", self._redis.delete(key))

    async def delete_if_equals(self, key: str, value: bytes) -> bool:
        return bool(await self._call("EVALSHA", self._delete_if_equals(keys=[key], args=[value])))

    async def get_int(self, key: str) -> int | None:
        value = await self._call("GET", self._redis.get(key))
        return None if value is None else int(value)

    async def hash_update(self, hash_key: str, put: dict[str, bytes], remove: list[str],
                          version_key: str) -> tuple[int, int]:
        pipe = self._redis.pipeline(transaction=True)
        pipe.hdel(hash_key, *remove) if remove else pipe.hlen(hash_key)
        if put:
            pipe.hset(hash_key, mapping=put)
        pipe.incr(version_key)
        results = await self._call("MULTI", pipe.execute())
        return int(results[-1]), int(results[0]) if remove else 0

    async def hash_read(self, hash_key: str, version_key: str) -> tuple[int | None, dict[str, bytes]]:
        pipe = self._redis.pipeline(transaction=True)
        pipe.get(version_key)
        pipe.hgetall(hash_key)
        version, fields = await self._call("MULTI", pipe.execute())
        return (None if version is None else int(version)), {k.decode(): v for k, v in fields.items()}

    async def hash_count(self, hash_key: str, fields: list[str]) -> tuple[int, int]:
        pipe = self._redis.pipeline(transaction=True)
        pipe.hlen(hash_key)
        pipe.hmget(hash_key, fields)
        size, values = await self._call("MULTI", pipe.execute())
        return int(size), sum(v is not None for v in values)

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        except (RedisError, OSError):
            pass  # closing a connection to a dead Redis has nothing left to do

    async def _call(self, operation: str, awaitable):
        try:
            return await asyncio.wait_for(awaitable, self._timeout)
        except asyncio.TimeoutError:
            raise BackendUnavailable(f"{self._where} did not answer {operation} within "
                                     f"{self._timeout:g}s") from None
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(f"{self._where} failed on {operation}: "
                                     f"{type(exc).__name__}: {exc}") from None


def make_backend(config: CacheConfig) -> MemoryBackend | RedisBackend:
    if config.backend == "redis":
        return RedisBackend(config)
    return MemoryBackend(config.max_memory_bytes)
