"""The host tier: a bounded store of evicted prefix blocks' KV, below the device pool.

The block manager decides what goes here and what comes back (services/target/engine/
block_manager.py): a cached full block it evicts from the device pool is queued for the
model runner to copy out (`ModelRunner.move_tiers`), and a prefix that misses the device
pool but hits here is restored into fresh device blocks instead of recomputed. This module
only holds the entries, keeps their byte bound (least recently stored dropped first) and
checks an entry before it is served.

An entry is one block's KV as raw bytes: every layer's keys, then values (and FP8 scales
where used), in the pool's order (`ModelRunner.kv_block_bytes`). It carries its chained-hash
key (parent hash, tokens, extra key: the model id and tenant salt are in the extra key) and
the identity it was computed under (model id, KV dtype, block size) with a checksum of its
bytes. `take` serves an entry only if all of these match; anything else (another model, a
truncated or corrupted entry) is dropped and the caller recomputes the block.

An entry is held in full precision, or in FP8 when the tier's cold-precision policy says so
(services/target/engine/kv_precision.py: long prefixes' later blocks, by setting or under
pressure when the model's measured accuracy cost allows): then its bytes are the FP8 pool's
layout, its identity says FP8 and its checksum covers those stored bytes; it is decoded into the
pool's dtype when served, so a restored FP8 block is close to, not equal to, what was computed.

Entries move between tiers, they are never in both: `take` removes what it serves (the
device pool owns a block in use), an eviction stores it again.

The tier also holds *swapped* sequences: a preempted sequence's whole KV (every block it
holds, the partial last one too) when moving it out and back is measured cheaper than
recomputing it (`swap_pays`). A swap is reserved under the same byte bound before its blocks
are released (`reserve_swap`; prefix entries are dropped for it, never the reverse), copied out
by the model runner before anything overwrites those blocks (`fill_swap`) and taken back when
the sequence resumes (`take_swap`). Swapped KV never leaves the process and is served only to
the sequence that stored it, so it carries no key or checksum, only its length is checked.
Under the same cold-precision policy as prefix entries, a swapped sequence's blocks from
`kv_cold_after_tokens` on are held in FP8 (`fp8`: always; `fp8-under-pressure`: when its full-
precision copy would push prefix entries out or not fit) and dequantized when it resumes; its
first blocks, and every block when the policy is off, come back byte-exact.
"""

from __future__ import annotations

import logging
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.target.engine.kv_precision import COLD, FULL, ColdPrecision

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TierIdentity:
    """What an entry was computed under; an entry of another identity is never served."""

    model_id: str
    kv_dtype: str
    block_size: int
    block_bytes: int  # bytes of one block's KV in every layer


@dataclass
class _Swap:
    """A swapped sequence's room in the tier, and its KV once copied out: its first `num_full`
    blocks as the pool's bytes, the rest in the FP8 pool's layout."""

    num_blocks: int
    num_full: int
    size: int  # bytes reserved: what the two parts hold once filled
    full: torch.Tensor | None = None  # [num_full, block_bytes] uint8
    cold: torch.Tensor | None = None  # [num_blocks - num_full, cold_bytes] uint8

    @property
    def filled(self) -> bool:
        return self.full is not None


@dataclass
class HostEntry:
    key: tuple  # (parent_hash, tokens, extra_key): the block's chained-hash key
    identity: TierIdentity
    data: torch.Tensor  # [block_bytes] uint8 on the host
    checksum: bytes
    origin: str = "host"  # "host": evicted from this pool; "shared": loaded from the shared tier
    precision: str = FULL  # FULL: the pool's bytes; COLD: the FP8 pool's layout (kv_precision.py)

    @classmethod
    def build(cls, key: tuple, data: torch.Tensor, identity: TierIdentity, origin: str = "host",
              precision: str = FULL) -> "HostEntry":
        return cls(key, identity, data, checksum(data), origin, precision)

    @property
    def num_bytes(self) -> int:
        return self.data.numel()


def checksum(data: torch.Tensor | memoryview) -> bytes:
    """Of a block's KV bytes: a [block_bytes] uint8 tensor, or the bytes as read from a store.

    CRC-32: it catches corrupted and truncated bytes (an unkeyed digest stops no deliberate writer
    either), at ~2 GB/s here against blake2b's ~0.75; with blake2b the digest was half of a
    default-model block's restore cost (~0.3 MB a block, checked on load and again on restore)."""
    buffer = data.contiguous().numpy() if isinstance(data, torch.Tensor) else data
    return struct.pack("<I", zlib.crc32(buffer))


@dataclass(frozen=True)
class HostTierStats:
    capacity_bytes: int
    used_bytes: int  # prefix entries and swapped sequences
    entries: int  # prefix entries
    stored_blocks: int  # evicted device blocks kept (not counting shared-tier loads)
    restored_blocks: int  # entries served back to the device pool
    restored_shared_blocks: int  # of those, entries loaded from the shared tier
    dropped_blocks: int  # entries dropped to keep the byte bound
    rejected_blocks: int  # entries that failed the identity, length or checksum check
    store_seconds: float  # copying out and checksumming
    restore_seconds: float  # checking and copying back
    swap_bytes: int = 0  # of used_bytes, held for swapped sequences
    swapped_out_blocks: int = 0  # preempted sequences' blocks copied out (counter)
    swapped_in_blocks: int = 0  # copied back when they resumed (counter)
    swap_out_seconds: float = 0.0
    swap_in_seconds: float = 0.0
    cold_precision: str = "off"  # the cold-precision policy as resolved (kv_precision.COLD_MODES)
    cold_entries: int = 0  # of entries, those held in FP8
    cold_bytes: int = 0  # of used_bytes, held by them
    cold_stored_blocks: int = 0  # of stored_blocks, stored in FP8 (counter)
    cold_restored_blocks: int = 0  # of restored_blocks, decoded from FP8 (counter)
    restored_bytes: int = 0  # of restored entries, as stored (FP8 entries at their FP8 size) (counter)
    cold_swapped_out_blocks: int = 0  # of swapped_out_blocks, stored in FP8 (counter)


class HostTier:
    """Bounded by `capacity_bytes`; thread-safe (the engine thread writes, stats read anywhere)."""

    def __init__(self, capacity_bytes: int, identity: TierIdentity, cold: ColdPrecision | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.cold = cold if cold is not None and cold.mode != "off" else None
        # What an FP8 entry of this tier is (the FP8 pool's format): None when the policy is off.
        self.cold_identity = None if self.cold is None else TierIdentity(
            identity.model_id, str(torch.float8_e4m3fn), identity.block_size, self.cold.codec.layout.cold_bytes)
        self._cold_mode = cold.mode if cold is not None else "off"
        self._cold_stored = self._cold_restored = self._cold_swapped_out = 0
        self._restored_bytes = 0
        # block hash -> (entry, bytes it was counted at); oldest first
        self._entries: OrderedDict[int, tuple[HostEntry, int]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._stored = self._restored = self._restored_shared = self._dropped = self._rejected = 0
        self._store_s = self._restore_s = 0.0
        self._recompute_s_per_block: float | None = None  # measured by the model runner (EWMA)
        self._swaps: dict[str, _Swap] = {}  # seq id -> its room and, once copied out, its KV
        self._swap_bytes = 0
        self._swapped_out = self._swapped_in = 0
        self._swap_out_s = self._swap_in_s = 0.0
        # Called (kind "stored" | "removed", block hash, key) as entries come and go: the engine
        # turns these into KV events for the prefix index (block_manager.tier_event).
        self.on_event: Callable[[str, int, tuple], None] | None = None

    def entry(self, key: tuple, data: torch.Tensor, origin: str = "host") -> HostEntry:
        """An entry of this tier's own identity."""
        return HostEntry.build(key, data, self.identity, origin)

    def store(self, block_hash: int, key: tuple, row: torch.Tensor, start_token: int) -> bool:
        """Stores an evicted block's KV (row [block_bytes] uint8, the pool's bytes; `start_token`:
        its first token's position in its prefix), in FP8 where the cold-precision policy says so."""
        if self.cold is not None:
            with self._lock:
                short = self._used + self._swap_bytes + self.identity.block_bytes > self.capacity_bytes
            if self.cold.wants_cold(start_token, short):
                data = self.cold.codec.encode(row.view(1, -1))[0]  # [cold_bytes] uint8
                return self.put(block_hash, HostEntry.build(key, data, self.cold_identity, precision=COLD))
        return self.put(block_hash, self.entry(key, row))

    def full_bytes(self, entry: HostEntry) -> torch.Tensor:
        """A checked entry's KV in the pool's bytes [block_bytes] uint8 (an FP8 entry decoded)."""
        if entry.precision == FULL:
            return entry.data
        return self.cold.codec.decode(entry.data.view(1, -1))[0]

    def has(self, block_hash: int, key: tuple) -> bool:
        """An entry is held under `block_hash` with this key (cheap: no checksum; `take` checks)."""
        with self._lock:
            held = self._entries.get(block_hash)
            return held is not None and held[0].key == key

    def put(self, block_hash: int, entry: HostEntry) -> bool:
        """Stores `entry`, dropping the oldest entries to stay within the bound; False when it
        cannot fit at all."""
        with self._lock:
            old = self._entries.pop(block_hash, None)
            if old is not None:
                self._used -= old[1]
            size = entry.num_bytes
            if size > self.capacity_bytes - self._swap_bytes:  # swapped sequences' room is not ours
                if old is not None:
                    self._event("removed", block_hash, old[0].key)
                return False
            self._make_room(size)
            self._entries[block_hash] = (entry, size)
            self._used += size
            self._event("stored", block_hash, entry.key)
            self._stored += entry.origin == "host"  # shared-tier loads are counted there
            self._cold_stored += entry.precision == COLD
            return True

    def take(self, block_hash: int, key: tuple) -> torch.Tensor | None:
        """Removes and returns the entry's bytes when it is intact and of this tier's identity;
        None otherwise (a bad entry is dropped: the caller recomputes the block)."""
        entry = self.take_entry(block_hash, key)
        return entry.data if entry is not None else None

    def take_entry(self, block_hash: int, key: tuple) -> HostEntry | None:
        """`take`, returning the checked entry (its origin says which tier it came from)."""
        with self._lock:
            held = self._entries.get(block_hash)
            if held is None or held[0].key != key:
                return None
            del self._entries[block_hash]
            entry, size = held
            self._used -= size
            self._event("removed", block_hash, entry.key)  # to the pool, or dropped as bad
        identity = self.identity if entry.precision == FULL else self.cold_identity  # None: FP8 not served here
        ok = (identity is not None and entry.identity == identity and entry.data.dtype == torch.uint8
              and entry.num_bytes == identity.block_bytes and checksum(entry.data) == entry.checksum)
        with self._lock:
            if ok:
                self._restored += 1
                self._restored_shared += entry.origin == "shared"
                self._cold_restored += entry.precision == COLD
                self._restored_bytes += entry.num_bytes
            else:
                self._rejected += 1
        return entry if ok else None

    def entry_of(self, block_hash: int) -> HostEntry | None:
        """The entry held under `block_hash` (tests and diagnostics)."""
        with self._lock:
            held = self._entries.get(block_hash)
            return held[0] if held else None

    def held(self) -> list[tuple[int, tuple]]:
        """(hash, key) of every entry, oldest first (a snapshot for the prefix index)."""
        with self._lock:
            return [(h, entry.key) for h, (entry, _) in self._entries.items()]

    def hashes(self) -> list[int]:
        """Block hashes held, oldest first."""
        with self._lock:
            return list(self._entries)

    # ---- swapped sequences ---------------------------------------------
    def swap_pays(self, num_blocks: int, num_tokens: int) -> bool:
        """Moving `num_blocks` blocks out and back costs less than recomputing `num_tokens` tokens,
        as measured here: swaps' own copies once there were any, until then this tier's stores and
        restores (the same copies plus a checksum each). True while either side is unmeasured, so
        the first swap measures it (as `restore_pays`)."""
        swap, recompute = self.swap_s_per_block, self.recompute_s_per_block
        if swap == 0.0 or recompute == 0.0:
            return True
        return num_blocks * swap < num_tokens * recompute / self.identity.block_size

    @property
    def swap_s_per_block(self) -> float:
        """Measured cost of copying one block out and back in (0 until measured)."""
        with self._lock:
            if self._swapped_out and self._swapped_in:
                return self._swap_out_s / self._swapped_out + self._swap_in_s / self._swapped_in
            if self._stored and self._restored:
                return self._store_s / self._stored + self._restore_s / self._restored
            return 0.0

    def reserve_swap(self, seq_id: str, num_blocks: int) -> bool:
        """Reserves room for `seq_id`'s swapped KV (its first `num_blocks` blocks, from its first
        token), dropping the oldest prefix entries as needed; False (nothing changed) when other
        swapped sequences leave too little of the bound. The blocks the cold-precision policy
        picks (`_swap_cold_blocks`) are reserved, and later held, at their FP8 size."""
        with self._lock:
            if seq_id in self._swaps:
                raise ValueError(f"{seq_id} is already swapped out")
            cold = self._swap_cold_blocks(num_blocks)
            size = (num_blocks - cold) * self.identity.block_bytes + cold * (
                self.cold.codec.layout.cold_bytes if cold else 0)
            if self._swap_bytes + size > self.capacity_bytes:
                return False
            self._make_room(size)
            self._swaps[seq_id] = _Swap(num_blocks, num_blocks - cold, size)
            self._swap_bytes += size
            return True

    def _swap_cold_blocks(self, num_blocks: int) -> int:
        """How many of a swapped sequence's `num_blocks` blocks go FP8 (lock held): those starting
        at or past the policy's `after_tokens`, always (`fp8`) or when the full-precision copy would
        push prefix entries out or not fit (`fp8-under-pressure`); none when the policy is off."""
        if self.cold is None:
            return 0
        bs = self.identity.block_size
        cold = max(0, num_blocks - -(-self.cold.after_tokens // bs))  # block i starts at token i * bs
        full_size = num_blocks * self.identity.block_bytes
        short = self._used + self._swap_bytes + full_size > self.capacity_bytes
        return cold if cold and self.cold.wants_cold(self.cold.after_tokens, short) else 0

    def fill_swap(self, seq_id: str, data: torch.Tensor) -> bool:
        """Stores the reserved swap's KV (data [num_blocks, block_bytes] uint8, copied out by the
        model runner; its cold blocks are encoded to FP8 here); False when no such reservation is
        held (the sequence ended meanwhile) or `data` is not its size."""
        with self._lock:
            held = self._swaps.get(seq_id)
            if (held is None or held.filled or data.dim() != 2 or data.shape[0] != held.num_blocks
                    or data.shape[1] != self.identity.block_bytes):
                return False
            num_full = held.num_full
        full = data[:num_full].clone() if num_full < held.num_blocks else data  # no hidden bytes kept
        cold = self.cold.codec.encode(data[num_full:]) if num_full < held.num_blocks else None
        with self._lock:
            if self._swaps.get(seq_id) is not held or held.filled:
                return False  # dropped (or filled) while it was encoded
            held.full, held.cold = full, cold
            self._swapped_out += held.num_blocks
            self._cold_swapped_out += held.num_blocks - num_full
            return True

    def take_swap(self, seq_id: str) -> torch.Tensor | None:
        """Removes and returns `seq_id`'s swapped KV [num_blocks, block_bytes] in the pool's bytes
        (FP8 blocks decoded); None when none was copied out (the caller must not use its blocks)."""
        with self._lock:
            swap = self._pop_swap(seq_id)
            if swap is None:
                return None
            self._swapped_in += swap.num_blocks
        if swap.cold is None:
            return swap.full
        return torch.cat([swap.full, self.cold.codec.decode(swap.cold)])  # [num_blocks, block_bytes]

    def drop_swap(self, seq_id: str) -> None:
        """Frees `seq_id`'s swap, if any (it ended while swapped out, or its copy-out failed)."""
        with self._lock:
            self._pop_swap(seq_id)

    def add_swap_time(self, out_s: float = 0.0, in_s: float = 0.0) -> None:
        with self._lock:
            self._swap_out_s += out_s
            self._swap_in_s += in_s

    def observe_recompute(self, seconds: float, num_tokens: int) -> None:
        """A forward pass computed `num_tokens` tokens in `seconds`: what recomputing costs."""
        per_block = seconds / num_tokens * self.identity.block_size
        with self._lock:
            old = self._recompute_s_per_block
            self._recompute_s_per_block = per_block if old is None else 0.8 * old + 0.2 * per_block

    @property
    def recompute_s_per_block(self) -> float:
        """Measured cost of recomputing one block (0 until measured)."""
        with self._lock:
            return self._recompute_s_per_block or 0.0

    def restore_pays(self) -> bool:
        """Restoring a block costs less than recomputing it, as measured so far (True until both
        are measured): the block manager recomputes host-tier hits otherwise."""
        with self._lock:
            if self._recompute_s_per_block is None or self._restored == 0:
                return True
            return self._restore_s / self._restored < self._recompute_s_per_block

    def add_time(self, store_s: float = 0.0, restore_s: float = 0.0) -> None:
        with self._lock:
            self._store_s += store_s
            self._restore_s += restore_s

    def _pop_swap(self, seq_id: str) -> _Swap | None:
        """Frees `seq_id`'s room; returns its swap if it was copied out (lock held)."""
        swap = self._swaps.pop(seq_id, None)
        if swap is None:
            return None
        self._swap_bytes -= swap.size
        return swap if swap.filled else None

    def _make_room(self, size: int) -> None:
        """Drops the oldest prefix entries until `size` more bytes fit the bound (lock held; the
        caller checked that swapped sequences leave room for `size`)."""
        while self._used + self._swap_bytes + size > self.capacity_bytes:
            h, (gone, dropped) = self._entries.popitem(last=False)
            self._used -= dropped
            self._dropped += 1
            self._event("removed", h, gone.key)

    def _event(self, kind: str, block_hash: int, key: tuple) -> None:
        """Tells `on_event` (lock held: events of one tier stay in order)."""
        if self.on_event is not None:
            try:
                self.on_event(kind, block_hash, key)
            except Exception:  # the index resyncs by snapshot; the tier must not fail for it
                log.exception("host tier: KV event callback failed")

    def stats(self) -> HostTierStats:
        with self._lock:
            cold = [size for entry, size in self._entries.values() if entry.precision == COLD]
            return HostTierStats(self.capacity_bytes, self._used + self._swap_bytes, len(self._entries),
                                 self._stored, self._restored, self._restored_shared, self._dropped, self._rejected,
                                 self._store_s, self._restore_s, self._swap_bytes, self._swapped_out,
                                 self._swapped_in, self._swap_out_s, self._swap_in_s, self._cold_mode,
                                 len(cold), sum(cold), self._cold_stored, self._cold_restored,
                                 self._restored_bytes, self._cold_swapped_out)


def build_host_tier(capacity_bytes: int, model_id: str, kv_dtype: torch.dtype, block_size: int,
                    block_bytes: int, cold: ColdPrecision | None = None) -> HostTier | None:
    """The engine's host tier; None when `capacity_bytes` is 0 (off). `cold`: its precision policy
    for evicted blocks (None: full precision always)."""
    if capacity_bytes == 0:
        return None
    return HostTier(capacity_bytes, TierIdentity(model_id, str(kv_dtype), block_size, block_bytes), cold)


def engine_stat_fields(tier: HostTier | None, block_size: int) -> dict:
    """The host tier's part of EngineStats (zeros when off)."""
    if tier is None:
        return {}
    s = tier.stats()
    own = s.restored_blocks - s.restored_shared_blocks  # restored by tier: the rest are the shared tier's
    return dict(host_tier_capacity_bytes=s.capacity_bytes, host_tier_bytes=s.used_bytes,
                host_tier_blocks=s.entries, host_tier_stored_blocks=s.stored_blocks,
                host_tier_restored_blocks=own, host_tier_restored_tokens=own * block_size,
                shared_tier_restored_blocks=s.restored_shared_blocks,
                shared_tier_restored_tokens=s.restored_shared_blocks * block_size,
                host_tier_dropped_blocks=s.dropped_blocks, host_tier_rejected_blocks=s.rejected_blocks,
                host_tier_store_seconds=s.store_seconds, host_tier_restore_seconds=s.restore_seconds,
                recompute_seconds_per_block=tier.recompute_s_per_block,
                host_tier_swap_bytes=s.swap_bytes, host_tier_swapped_out_blocks=s.swapped_out_blocks,
                host_tier_swapped_in_blocks=s.swapped_in_blocks, host_tier_swap_out_seconds=s.swap_out_seconds,
                host_tier_swap_in_seconds=s.swap_in_seconds, swap_seconds_per_block=tier.swap_s_per_block,
                host_tier_cold_precision=s.cold_precision, host_tier_cold_blocks=s.cold_entries,
                host_tier_cold_bytes=s.cold_bytes, host_tier_cold_stored_blocks=s.cold_stored_blocks,
                host_tier_cold_restored_blocks=s.cold_restored_blocks, host_tier_restore_bytes=s.restored_bytes,
                host_tier_cold_swapped_out_blocks=s.cold_swapped_out_blocks,
                host_tier_restore_bandwidth=s.restored_bytes / s.restore_seconds
                if s.restored_bytes and s.restore_seconds > 0 else 0.0)
