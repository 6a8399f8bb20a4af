"""The shared tier: prefix blocks' KV in Redis, below the host tier, readable by every replica.

Writes: when the block manager registers a newly committed full block in the prefix cache it
queues the block for this tier (`BlockManager.commit`, `wants`); the model runner copies its
KV out with the step's other tier moves (`ModelRunner.move_tiers`) and `offer`s the bytes to a
bounded queue. A writer thread checksums, frames and writes them (`SET ... NX EX ttl`), so
the engine thread never waits for Redis; when the queue is full the write is dropped.
Written on commit rather than on eviction: another replica can load a prefix while the
replica that computed it still holds it in its pool.

Reads: before a request is queued on the engine, `prefetch` (off the engine thread) walks the
prompt's chained block hashes past the blocks this replica holds, fetches the following
entries with a per-call timeout, checks each, and puts the good ones into the host tier, from
which admission restores them like any host-tier hit (the host tier checks them again).

Entry: `MAGIC | u32 header length | JSON header | KV bytes`. The header carries the model id,
KV dtype, block size, block bytes, a digest of the block's chained-hash key (parent hash,
tokens, extra key: the tenant salt is in the extra key, and only its digest is stored) and a
checksum of the KV bytes. A missing, truncated, corrupted or foreign entry, or an entry of
another key under the same hash, is never served: those blocks are recomputed.

Bound: this replica accounts the bytes it wrote (oldest first) and deletes its own oldest
entries when a write would pass `capacity_bytes`; every entry also expires after `ttl_s`, so
a replica that restarts (and forgets what it wrote) leaves nothing behind for longer than that.
Redis down: loads and writes fail fast, are counted, and for a second nothing is tried.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import redis
import torch

from services.target.engine.host_tier import HostEntry, HostTier, TierIdentity, checksum

log = logging.getLogger(__name__)
MAGIC = b"SMKV"
_VERSION = 2  # 2: the checksum is CRC-32 (1: blake2b)
_BACKOFF_S = 1.0  # after a Redis error nothing is tried for this long
_BATCH = 8  # entries per write round trip
_LOAD_BYTES = 64 << 20  # entries' bytes per load round trip (one MGET reply)
_MAX_KNOWN = 1 << 16  # hashes remembered as written (by this replica or found written)


@dataclass(frozen=True)
class SharedTierStats:
    capacity_bytes: int
    written_bytes: int  # bytes of this replica's entries, as accounted now
    written_blocks: int  # entries this replica wrote (counter)
    deleted_blocks: int  # own entries deleted to keep the byte bound (counter)
    dropped_writes: int  # writes dropped: queue full or Redis down (counter)
    loaded_blocks: int  # checked entries put into the host tier (counter)
    rejected_blocks: int  # entries failing the identity, key, length or checksum check (counter)
    errors: int  # Redis calls that failed or timed out (counter)
    write_seconds: float
    load_seconds: float


class SharedTier:
    def __init__(self, client: redis.Redis, key_prefix: str, identity: TierIdentity, capacity_bytes: int,
                 ttl_s: int, queue_size: int = 256) -> None:
        if capacity_bytes <= 0 or ttl_s <= 0:
            raise ValueError(f"capacity_bytes and ttl_s must be > 0, got {capacity_bytes}, {ttl_s}")
        self.client = client
        self.key_prefix = key_prefix
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        # hash -> (bytes this replica accounts: 0 = not ours, key); oldest first
        self._known: OrderedDict[int, tuple[int, tuple]] = OrderedDict()
        # Called (kind "stored" | "removed", block hash, key) for this replica's own entries (the
        # engine turns these into KV events for the prefix index). Entries that expire are not told.
        self.on_event: Callable[[str, int, tuple], None] | None = None
        self._queued: set[int] = set()
        self._used = 0
        self._written = self._deleted = self._dropped = self._loaded = self._rejected = self._errors = 0
        self._write_s = self._load_s = 0.0
        self._down_until = 0.0
        self._stop = False
        self._writer = threading.Thread(target=self._write_loop, name="shared-tier-writer", daemon=True)
        self._writer.start()

    # ---- the engine thread ---------------------------------------------
    def wants(self, block_hash: int) -> bool:
        """The block is neither written (as far as this replica knows) nor queued."""
        with self._lock:
            return block_hash not in self._known and block_hash not in self._queued

    def offer(self, block_hash: int, key: tuple, data: torch.Tensor) -> bool:
        """Queues `data` ([block_bytes] uint8, a copy) to be written; never blocks: False (dropped)
        when the queue is full."""
        with self._lock:
            self._queued.add(block_hash)
        try:
            self._queue.put_nowait((block_hash, key, data))
            return True
        except queue.Full:
            with self._lock:
                self._queued.discard(block_hash)
                self._dropped += 1
            return False

    # ---- any thread ------------------------------------------------------
    def load(self, blocks: list[tuple[int, tuple]], max_bytes: int) -> list[HostEntry]:
        """The checked entries (origin "shared", their checksum verified here and kept, so the host
        tier need not compute it again) of the leading `blocks` ((hash, key) in chain order) that
        the store holds, up to the first missing or bad one and at most `max_bytes`; [] when Redis
        is down or slow. One MGET per `_LOAD_BYTES` of entries (a 2,000-token prefix of the default
        model in one round trip), not per few entries: fewer round trips and reply buffers."""
        limit = min(len(blocks), max_bytes // self.identity.block_bytes)
        per_call = max(1, _LOAD_BYTES // self.identity.block_bytes)
        out: list[HostEntry] = []
        if limit == 0 or self._is_down():
            return out
        start = time.perf_counter()
        try:
            for i in range(0, limit, per_call):
                batch = blocks[i:min(i + per_call, limit)]
                values = self.client.mget([self.redis_key(h) for h, _ in batch])
                for (_, key), value in zip(batch, values):
                    entry = self.parse(value, key) if value is not None else None
                    if entry is None:
                        return out
                    out.append(entry)
        except redis.RedisError as exc:
            self._failed("load", exc)
        finally:
            with self._lock:
                self._loaded += len(out)
                self._load_s += time.perf_counter() - start
        return out

    def redis_key(self, block_hash: int) -> str:
        return f"{self.key_prefix}:{self.identity.model_id}:{block_hash:016x}"

    def frame(self, key: tuple, data: torch.Tensor) -> bytes:
        """An entry as stored: magic, header length, header, KV bytes."""
        ident = self.identity
        header = json.dumps({"v": _VERSION, "model": ident.model_id, "dtype": ident.kv_dtype,
                             "block_size": ident.block_size, "block_bytes": ident.block_bytes,
                             "key": key_digest(key), "sum": checksum(data).hex()}).encode()
        return MAGIC + struct.pack("<I", len(header)) + header + data.contiguous().numpy().tobytes()

    def parse(self, value: bytes, key: tuple) -> HostEntry | None:
        """The entry (its KV bytes [block_bytes] uint8, origin "shared") if it is intact, of this
        tier's identity and of `key`; None otherwise (counted as rejected)."""
        ident = self.identity
        try:
            (size,) = struct.unpack_from("<I", value, len(MAGIC))
            header = json.loads(value[len(MAGIC) + 4:len(MAGIC) + 4 + size])
            body = memoryview(value)[len(MAGIC) + 4 + size:]  # no copy until the check passed
            ok = (value[:len(MAGIC)] == MAGIC and header["v"] == _VERSION and header["model"] == ident.model_id
                  and header["dtype"] == ident.kv_dtype and header["block_size"] == ident.block_size
                  and header["block_bytes"] == ident.block_bytes == len(body) and header["key"] == key_digest(key))
            digest = checksum(body) if ok else b""
            ok = ok and digest.hex() == header["sum"]
        except (ValueError, KeyError, TypeError, struct.error):
            ok = False
        if not ok:
            with self._lock:
                self._rejected += 1
            return None
        data = torch.frombuffer(bytearray(body), dtype=torch.uint8)  # [block_bytes], writable: one copy
        return HostEntry(key, ident, data, digest, origin="shared")

    def held(self) -> list[tuple[int, tuple]]:
        """(hash, key) of this replica's own entries as accounted, oldest first (a snapshot)."""
        with self._lock:
            return [(h, key) for h, (size, key) in self._known.items() if size]

    def stats(self) -> SharedTierStats:
        with self._lock:
            return SharedTierStats(self.capacity_bytes, self._used, self._written, self._deleted, self._dropped,
                                   self._loaded, self._rejected, self._errors, self._write_s, self._load_s)

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until every queued write is done (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queued:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._stop = True
        self._writer.join(timeout=5.0)
        self.client.close()

    # ---- helpers -------------------------------------------------------
    def _write_loop(self) -> None:
        while not self._stop:
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
            except Exception:  # never let the writer die: a lost write is a recompute elsewhere
                log.exception("shared tier: writing %d blocks failed", len(batch))
            finally:
                with self._lock:
                    self._queued.difference_update(h for h, _, _ in batch)

    def _write(self, batch: list[tuple[int, tuple, torch.Tensor]]) -> None:
        if self._is_down():
            with self._lock:
                self._dropped += len(batch)
            return
        start = time.perf_counter()
        values, total = [], 0
        for h, key, data in batch:
            value = self.frame(key, data)
            if total + len(value) <= self.capacity_bytes:  # what cannot fit at all is dropped
                values.append((h, value))
                total += len(value)
        with self._lock:
            self._dropped += len(batch) - len(values)
        if not values:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for h in self._make_room(total):
                pipe.delete(self.redis_key(h))
            for h, value in values:
                pipe.set(self.redis_key(h), value, nx=True, ex=self.ttl_s)
            results = pipe.execute()[-len(values):]
        except redis.RedisError as exc:
            self._failed("write", exc)
            with self._lock:
                self._dropped += len(batch)
            return
        keys = {h: key for h, key, _ in batch}
        with self._lock:
            for (h, value), written in zip(values, results):
                ours = len(value) if written else 0  # not written: already there (another writer's)
                self._known[h] = (ours, keys[h])
                self._used += ours
                self._written += 1 if written else 0
                if written:
                    self._event("stored", h, keys[h])
            while len(self._known) > _MAX_KNOWN:
                h, (size, key) = self._known.popitem(last=False)
                self._used -= size  # forgotten: left to its TTL
                if size:
                    self._event("removed", h, key)
            self._write_s += time.perf_counter() - start

    def _make_room(self, incoming: int) -> list[int]:
        """Own entries to delete, oldest first, so that `incoming` more bytes stay within the bound."""
        out = []
        with self._lock:
            for h in list(self._known):
                if self._used + incoming <= self.capacity_bytes:
                    break
                size, key = self._known.pop(h)
                if size:
                    self._used -= size
                    self._deleted += 1
                    out.append(h)
                    self._event("removed", h, key)
        return out

    def _event(self, kind: str, block_hash: int, key: tuple) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, block_hash, key)
            except Exception:  # the index resyncs by snapshot; writing must not fail for it
                log.exception("shared tier: KV event callback failed")

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, what: str, exc: Exception) -> None:
        with self._lock:
            self._errors += 1
            self._down_until = time.monotonic() + _BACKOFF_S
        log.warning("shared tier: %s failed (%s: %s); recomputing instead for %.0f s",
                    what, type(exc).__name__, exc, _BACKOFF_S)


def key_digest(key: tuple) -> str:
    """A digest of a block's chained-hash key (parent hash, tokens, extra key): it checks the key
    without storing the tenant salt."""
    parent, tokens, extra_key = key
    h = hashlib.blake2b(digest_size=16, person=b"specmesh-kv-key")
    h.update(struct.pack("<Q", 0 if parent is None else parent))
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    h.update(extra_key.encode())
    return h.hexdigest()


def prefetch(blocks, host: HostTier, shared: SharedTier, blocks_keys: list[tuple[int, tuple]]) -> int:
    """Loads the shared tier's entries that continue the prompt's held prefix into the host tier
    (from the prefetching thread, before the request is queued); returns how many.

    `blocks.holds` is a hint read off the engine thread: a stale answer costs a fetch or misses
    one, never a wrong token (admission matches again, and the host tier checks each entry)."""
    i = 0
    while i < len(blocks_keys) and (blocks.holds(blocks_keys[i][0]) or host.has(*blocks_keys[i])):
        i += 1
    wanted = blocks_keys[i:]
    if not wanted:
        return 0
    loaded = shared.load(wanted, host.capacity_bytes // 2)  # half: the chain must not push itself out
    for (h, _), entry in zip(wanted, loaded):
        host.put(h, entry)  # checked on load, its checksum kept: `take` checks it again
    return len(loaded)


def build_shared_tier(url: str, key_prefix: str, capacity_bytes: int, ttl_s: int, timeout_s: float,
                      identity: TierIdentity) -> SharedTier | None:
    """The engine's shared tier; None when `url` is empty (off). Connects lazily: a Redis that is
    down now only means recompute until it is up."""
    if not url:
        return None
    # Reads of 1 MiB, not redis-py's 64 KiB: an entry is ~0.3 MB (the default model's block), and
    # a load reads many; fewer, larger reads took ~25% off a 124-block load here.
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  socket_read_size=1 << 20)
    return SharedTier(client, key_prefix, identity, capacity_bytes, ttl_s)


def engine_stat_fields(tier: SharedTier | None) -> dict:
    """The shared tier's part of EngineStats (zeros when off)."""
    if tier is None:
        return {}
    s = tier.stats()
    return dict(shared_tier_capacity_bytes=s.capacity_bytes, shared_tier_bytes=s.written_bytes,
                shared_tier_written_blocks=s.written_blocks, shared_tier_deleted_blocks=s.deleted_blocks,
                shared_tier_dropped_writes=s.dropped_writes, shared_tier_loaded_blocks=s.loaded_blocks,
                shared_tier_rejected_blocks=s.rejected_blocks, shared_tier_errors=s.errors,
                shared_tier_write_seconds=s.write_seconds, shared_tier_load_seconds=s.load_seconds)
