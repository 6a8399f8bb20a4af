"""The one owner of KV blocks: free list, reference counts, block tables and the prefix cache.

Terms:
- A *full* block holds `block_size` committed tokens. Full blocks get a chained hash
  `h(parent_hash, tokens, extra_key)`; `extra_key` carries the model id and the tenant
  salt, so equal tokens of different tenants never share a block.
- A *cached* block is a full block registered under its hash. When no sequence
  references it (ref count 0) it waits in LRU order and is evicted only when a fresh
  block is needed and no never-cached free block is left.

- A *fork* (n samples of one prompt) gives a new sequence the blocks of another by
  reference count, no KV copied. A shared *partial* last block is copied on write: the
  first `reserve` of a sharer that grows past it takes a fresh block and queues a
  (source, destination) block copy, which the engine runs before the next forward pass
  (`take_copies`); the last sharer keeps the original.
- The *host tier* (optional, services/target/engine/host_tier.py) sits below the pool: an
  evicted cached block's KV is queued to be copied there, and a prompt whose next blocks miss
  the pool but are held there gets fresh blocks that the KV is restored into instead of
  being recomputed; both moves run before the next forward pass (`take_tier_moves`), and
  restored tokens count as cached for admission.
- The *shared tier* (optional, services/target/engine/shared_tier.py) sits below the host tier,
  in Redis: a block newly registered here is queued to be written there too (its KV copied out
  with the step's other tier moves); what other replicas wrote reaches this pool through the
  host tier (`shared_tier.prefetch`, before a request is queued).
- A *swapped* sequence (preempted, `swap_out`) has its whole KV, every block up to its computed
  tokens with the partial last one, copied to the host tier instead of dropped, when the tier
  measures that cheaper than recomputing it and has room; its blocks go back to the pool at
  once (the copy-out runs before the next forward pass, like an eviction's store), and when it
  resumes (`resume`) fresh blocks take its KV back. This works with prefix caching off too:
  then the tier holds only swapped sequences. The tier's cold-precision policy may hold its
  blocks past `kv_cold_after_tokens` in FP8 (then they come back close to, not equal to, what
  was computed; off, the default for a model nothing was measured for, they come back exact).

Check, then commit: `can_reserve` / `can_admit` before `reserve` / `admit`; a call that
cannot be satisfied raises `OutOfBlocks` and changes nothing. Everything else in the
engine asks this module and never edits a table.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from time import perf_counter

from services.common.block_hash import block_hash  # shared with the router
from services.target.engine.host_tier import HostTier
from services.target.engine.shared_tier import SharedTier


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks for the request; nothing was allocated."""


@dataclass(frozen=True)
class BlockStats:
    num_blocks: int
    free_blocks: int  # allocatable: never-cached free + evictable cached
    used_blocks: int  # referenced by at least one sequence
    cached_blocks: int  # registered in the prefix cache (used or evictable)
    evictions: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int


@dataclass(frozen=True)
class KVEvent:
    """A change of the prefix cache, for subscribers (the cache service's prefix index)."""

    kind: str  # "stored" | "removed"
    block_hash: int
    parent_hash: int | None
    num_tokens: int
    scope: str  # short digest of the extra key: groups a tenant's blocks, reveals no salt
    tier: str = "device"  # "device" (this pool) | "host" | "shared" (see tier_event)


@dataclass(frozen=True)
class PrefixMatch:
    """The cached full blocks that start a prompt (from `match_prefix`, not yet acquired):
    those in the device pool, then those only the host tier holds (restored at `admit`)."""

    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]
    num_tokens: int  # of both tiers
    host_blocks: tuple[tuple[int, tuple], ...] = ()  # (hash, key) held by the host tier, after block_ids
    num_restored_tokens: int = 0  # as admitted (`admit`): of num_tokens, those restored from the host tier
    num_shared_tokens: int = 0  # of num_restored_tokens, those the shared tier had loaded there

    @property
    def all_hashes(self) -> tuple[int, ...]:
        """The matched blocks' chained hashes in order: the pool's, then the host tier's."""
        return self.hashes + tuple(h for h, _ in self.host_blocks)

    def first(self, n: int) -> PrefixMatch:
        """The match cut to its first `n` blocks (for `admit`, before it)."""
        total = len(self.block_ids) + len(self.host_blocks)
        if n >= total:
            return self
        n = max(n, 0)
        pool = min(n, len(self.block_ids))
        return PrefixMatch(self.block_ids[:pool], self.hashes[:pool], self.num_tokens // total * n,
                           self.host_blocks[:n - pool])


@dataclass(frozen=True)
class TierMoves:
    """KV moves between the device pool and the host tier, for the model runner to run before
    the next forward pass (`ModelRunner.move_tiers`), stores first: a stored block may be the
    destination of a restore or a copy-on-write copy of the same step."""

    tier: HostTier | None
    # (block id, hash, key, first token's position in its prefix) of evicted blocks, KV still in place
    stores: list[tuple[int, int, tuple, int]]
    restores: list[tuple[int, object]]  # (destination block id, the pool's bytes: [block_bytes] uint8)
    shared: SharedTier | None = None
    shares: list[tuple[int, int, tuple]] = field(default_factory=list)  # (block id, hash, key) to write there
    # Swapped sequences: (seq id, its blocks in order) to copy out with the stores, and (seq id,
    # fresh blocks) to copy its KV back into with the restores (`swap_out`, `resume`).
    swap_outs: list[tuple[str, list[int]]] = field(default_factory=list)
    swap_ins: list[tuple[str, list[int]]] = field(default_factory=list)


@dataclass
class _Block:
    ref_count: int = 0
    hash: int | None = None
    key: tuple | None = None  # (parent_hash, tokens, extra_key): the collision check
    index: int = 0  # of a cached block: its place in its prefix (the host tier's precision depends on it)


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of the leading full committed blocks
    reserved_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_tier: HostTier | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # never cached (or evicted), lowest ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self._cached: dict[int, int] = {}  # hash -> block id
        self._seqs: dict[str, _SeqBlocks] = {}
        self._events: list[KVEvent] = []  # taken by drain_events
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) blocks; see take_copies
        self.host_tier = host_tier  # None = evicted blocks are dropped, preempted sequences recomputed
        self._stores: list[tuple[int, int, tuple, int]] = []  # see take_tier_moves
        self._restores: list[tuple[int, object]] = []
        self.shared_tier: SharedTier | None = None  # see attach_shared_tier
        self._shares: list[tuple[int, int, tuple]] = []
        self._swapped: dict[str, int] = {}  # seq id -> tokens whose KV the host tier holds (see swap_out)
        self._swap_outs: list[tuple[str, list[int]]] = []
        self._swap_ins: list[tuple[str, list[int]]] = []
        self._evictions = self._queries = self._query_tokens = self._hit_tokens = 0

    def attach_host_tier(self, tier: HostTier | None) -> None:
        """Evicted cached blocks and swapped sequences go to `tier` from now on (None: dropped,
        recomputed). Without prefix caching nothing is cached: it holds swapped sequences only."""
        self.host_tier = tier

    def attach_shared_tier(self, tier: SharedTier | None) -> None:
        """Newly committed cached blocks are written to `tier` from now on (None: nowhere)."""
        self.shared_tier = tier if self.enable_prefix_caching else None

    # ---- queries -------------------------------------------------------
    def holds(self, block_hash: int) -> bool:
        """The pool has a block cached under `block_hash`: safe from any thread as a hint only
        (one dict lookup; the answer may be stale by the time it is read)."""
        return block_hash in self._cached

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> set[str]:
        """Sequences holding blocks or swapped-out KV."""
        return set(self._seqs) | set(self._swapped)

    def swapped_tokens(self, seq_id: str) -> int:
        """Tokens of `seq_id`'s KV swapped out to the host tier (0: none; it recomputes)."""
        return self._swapped.get(seq_id, 0)

    def block_table(self, seq_id: str) -> list[int]:
        entry = self._seqs.get(seq_id)
        return list(entry.table) if entry else []

    def prefix_hashes(self, seq_id: str) -> list[int]:
        """Chained hashes of the sequence's leading full committed blocks (block i's at i; none
        without prefix caching). The block manager's own list: read it, never change it."""
        entry = self._seqs.get(seq_id)
        return entry.hashes if entry else []

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def evictable_order(self) -> list[int]:
        """Cached unreferenced blocks, next to be evicted first."""
        return list(self._evictable)

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        return self.slots_at(seq_id, range(start, end))

    def slots_at(self, seq_id: str, indices) -> list[int]:
        """Pool slots of the sequence's token indices."""
        table, bs = self._seqs[seq_id].table, self.block_size
        return [table[i // bs] * bs + i % bs for i in indices]

    def can_reserve(self, seq_id: str, num_tokens: int) -> bool:
        return self._missing(seq_id, num_tokens) <= self.num_free

    def match_prefix(self, token_ids: list[int], extra_key: str) -> PrefixMatch:
        """The longest run of cached full blocks that starts `token_ids` (changes nothing): in the
        pool, then in the host tier while restoring is measured cheaper than recomputing.

        At least one token is always left uncached so that the prompt's last position
        is computed and yields logits.
        """
        ids, hashes, host, parent = [], [], [], None
        tier = self.host_tier if self.host_tier is not None and self.host_tier.restore_pays() else None
        if self.enable_prefix_caching:
            for i in range((len(token_ids) - 1) // self.block_size):
                tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
                h = block_hash(parent, tokens, extra_key)
                key = (parent, tokens, extra_key)
                block_id = self._cached.get(h)
                if not host and block_id is not None and self._blocks[block_id].key == key:
                    ids.append(block_id)
                    hashes.append(h)
                elif tier is not None and tier.has(h, key):
                    host.append((h, key))  # the key is the collision check, as in the pool
                else:
                    break  # miss, or a hash collision: treat as a miss
                parent = h
        return PrefixMatch(tuple(ids), tuple(hashes), (len(ids) + len(host)) * self.block_size, tuple(host))

    def can_admit(self, match: PrefixMatch, num_tokens: int) -> bool:
        """Whether a new sequence starting with `match` can hold `num_tokens` tokens (host-tier
        blocks of the match need fresh blocks, like uncached ones)."""
        revived = sum(1 for b in match.block_ids if self._blocks[b].ref_count == 0)
        missing = max(0, self.blocks_for(num_tokens) - len(match.block_ids))
        return missing + revived <= self.num_free

    def cached_blocks(self) -> list[KVEvent]:
        """Every cached block as a "stored" event (a snapshot for new subscribers)."""
        out = []
        for h, block_id in self._cached.items():
            parent, tokens, extra_key = self._blocks[block_id].key
            out.append(KVEvent("stored", h, parent, len(tokens), _scope(extra_key)))
        return out

    def drain_events(self) -> list[KVEvent]:
        """Prefix-cache events (blocks stored and removed) since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self) -> BlockStats:
        used = self.num_blocks - self.num_free  # every block is free, evictable or referenced
        return BlockStats(self.num_blocks, self.num_free, used, len(self._cached), self._evictions,
                          self._queries, self._query_tokens, self._hit_tokens)

    def slot_usage(self) -> tuple[int, int]:
        """(allocated slots, slots holding or being filled with KV) over referenced blocks."""
        fill: dict[int, int] = {}
        for entry in self._seqs.values():
            n = entry.reserved_tokens
            for i, block_id in enumerate(entry.table):
                used = min(self.block_size, max(0, n - i * self.block_size))
                fill[block_id] = max(fill.get(block_id, 0), used)
        return len(fill) * self.block_size, sum(fill.values())

    # ---- changes -------------------------------------------------------
    def admit(self, seq_id: str, match: PrefixMatch, num_tokens: int, num_prompt_tokens: int) -> PrefixMatch:
        """Starts `seq_id`'s table with the matched cached blocks, then reserves up to `num_tokens`.

        The match's host-tier blocks are taken from the tier (checked there: identity, length,
        checksum) into fresh blocks, registered in the prefix cache and queued for restore; the
        first that fails the check ends the match there, and it and the rest are computed.
        Returns the match as admitted: the sequence's KV is valid up to its `num_tokens`."""
        if seq_id in self._seqs:
            raise ValueError(f"{seq_id} already holds blocks")
        if not self.can_admit(match, num_tokens):
            raise OutOfBlocks(f"{seq_id}: not enough free blocks for {num_tokens} tokens")
        for block_id in match.block_ids:
            self._acquire(block_id)
        entry = self._seqs[seq_id] = _SeqBlocks(list(match.block_ids), list(match.hashes))
        if match.host_blocks:
            restored, shared = self._restore_into(entry, match.host_blocks)
            match = PrefixMatch(tuple(entry.table), tuple(entry.hashes), len(entry.table) * self.block_size,
                                num_restored_tokens=restored * self.block_size,
                                num_shared_tokens=shared * self.block_size)
        self._queries += 1
        self._query_tokens += num_prompt_tokens
        self._hit_tokens += match.num_tokens
        self.reserve(seq_id, num_tokens)
        return match

    def reserve(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grows `seq_id`'s table to hold `num_tokens` tokens; returns the new block ids.

        A shared partial last block that the growth writes into is copied first (copy-on-write):
        its copy is among the returned ids and (old, new) is queued for `take_copies`."""
        missing = self._missing(seq_id, num_tokens)
        if missing > self.num_free:
            raise OutOfBlocks(f"{seq_id}: need {missing} blocks, {self.num_free} free")
        entry = self._seqs.setdefault(seq_id, _SeqBlocks())
        copied = []
        if self._shared_tail(entry, num_tokens) is not None:
            i = entry.reserved_tokens // self.block_size
            old, copy = entry.table[i], self._take_free_block()
            entry.table[i] = copy
            self._decref(old)
            self._copies.append((old, copy))
            copied.append(copy)
            missing -= 1
        new = [self._take_free_block() for _ in range(missing)]
        entry.table.extend(new)
        entry.reserved_tokens = max(entry.reserved_tokens, num_tokens)
        return copied + new

    def commit(self, seq_id: str, token_ids: list[int], num_committed: int, extra_key: str) -> None:
        """Registers the sequence's full blocks whose tokens are all committed (KV computed)."""
        if not self.enable_prefix_caching:
            return
        entry, bs = self._seqs[seq_id], self.block_size
        while (len(entry.hashes) + 1) * bs <= num_committed:
            i = len(entry.hashes)
            parent = entry.hashes[-1] if entry.hashes else None
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, tokens, extra_key)
            block = self._blocks[entry.table[i]]
            if h not in self._cached and block.hash is None:
                block.hash, block.key, block.index = h, (parent, tokens, extra_key), i
                self._cached[h] = entry.table[i]
                self._events.append(KVEvent("stored", h, parent, bs, _scope(extra_key)))
                if self.shared_tier is not None and self.shared_tier.wants(h):
                    self._shares.append((entry.table[i], h, block.key))
            entry.hashes.append(h)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Starts `child_id` with `parent_id`'s blocks holding its first `num_tokens` tokens, shared
        by reference count (another sample of the same prompt); no block is taken or copied here.

        The parent must hold exactly those tokens (a step boundary: nothing reserved beyond), so
        that each sharer's next `reserve` is its first write past them (copy-on-write of a
        partial last block)."""
        parent = self._seqs.get(parent_id)
        if parent is None:
            raise ValueError(f"{parent_id} holds no blocks")
        if child_id in self._seqs:
            raise ValueError(f"{child_id} already holds blocks")
        keep = self.blocks_for(num_tokens)
        if parent.reserved_tokens != num_tokens or len(parent.table) != keep:
            raise ValueError(f"{parent_id} must hold exactly {num_tokens} tokens to fork, holds "
                             f"{parent.reserved_tokens} in {len(parent.table)} blocks")
        for block_id in parent.table:
            self._acquire(block_id)
        self._seqs[child_id] = _SeqBlocks(list(parent.table), parent.hashes[:num_tokens // self.block_size],
                                          num_tokens)

    def swap_out(self, seq_id: str, num_tokens: int, by_cost: bool = True) -> bool:
        """Preempts `seq_id` by swap: its first `num_tokens` tokens' KV (the blocks holding them,
        a partial last one included) is queued to be copied to the host tier and its blocks are
        released. False, changing nothing, when there is no tier, swapping is measured dearer
        than recomputing those tokens (`by_cost`), or the tier's bound leaves no room: the caller
        releases the sequence and recomputes it."""
        entry, tier = self._seqs.get(seq_id), self.host_tier
        num_blocks = self.blocks_for(num_tokens)
        if tier is None or entry is None or num_tokens <= 0 or num_blocks > len(entry.table):
            return False
        if by_cost and not tier.swap_pays(num_blocks, num_tokens) or not tier.reserve_swap(seq_id, num_blocks):
            return False
        self._swap_outs.append((seq_id, entry.table[:num_blocks]))  # KV in place until the next forward pass
        self._swapped[seq_id] = num_tokens
        self._drop_table(seq_id)
        return True

    def can_resume(self, num_tokens: int) -> bool:
        """Whether a swapped sequence can come back holding `num_tokens` tokens (all fresh blocks)."""
        return self.blocks_for(num_tokens) <= self.num_free

    def resume(self, seq_id: str, num_tokens: int) -> None:
        """Brings a swapped sequence back: fresh blocks for `num_tokens` tokens (at least its swapped
        ones), its swapped KV queued to be copied into the first of them. Its full blocks enter
        the prefix cache again at its next `commit`."""
        swapped = self._swapped.get(seq_id)
        if swapped is None:
            raise ValueError(f"{seq_id} is not swapped out")
        if num_tokens < swapped:
            raise ValueError(f"{seq_id}: resuming with {num_tokens} tokens, {swapped} are swapped out")
        if seq_id in self._seqs:
            raise ValueError(f"{seq_id} already holds blocks")
        if not self.can_resume(num_tokens):
            raise OutOfBlocks(f"{seq_id}: not enough free blocks to resume {num_tokens} tokens")
        del self._swapped[seq_id]
        table = self.reserve(seq_id, num_tokens)
        self._swap_ins.append((seq_id, table[:self.blocks_for(swapped)]))

    def lose_swaps(self, seq_ids: list[str]) -> None:
        """Their swap-out failed: they recompute when they resume (engine thread, between steps)."""
        for seq_id in seq_ids:
            if self._swapped.pop(seq_id, None) is not None and self.host_tier is not None:
                self.host_tier.drop_swap(seq_id)

    def take_tier_moves(self) -> TierMoves:
        """Host-tier stores (evicted blocks), swap-outs, restores (admitted host hits) and swap-ins
        queued since the last call; the engine runs them before copy-on-write copies and the next
        forward pass."""
        moves = TierMoves(self.host_tier, self._stores, self._restores, self.shared_tier, self._shares,
                          self._swap_outs, self._swap_ins)
        self._stores, self._restores, self._shares, self._swap_outs, self._swap_ins = [], [], [], [], []
        return moves

    def forget(self, block_ids: list[int]) -> None:
        """Takes blocks out of the prefix cache (their restore failed: their KV is not valid).
        Their sequences keep them; they are free once released."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.hash is not None and self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
                parent, tokens, extra_key = block.key
                self._events.append(KVEvent("removed", block.hash, parent, len(tokens), _scope(extra_key)))
            block.hash = block.key = None

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies (source, destination) queued since the last call, in order;
        the engine runs them before the next forward pass writes any KV."""
        copies, self._copies = self._copies, []
        return copies

    def truncate(self, seq_id: str, num_tokens: int) -> int:
        """Frees the sequence's trailing blocks beyond `num_tokens` (e.g. rejected draft slots).

        Only blocks that hold no committed token go; returns how many were freed.
        """
        entry = self._seqs[seq_id]
        keep = self.blocks_for(num_tokens)
        extra = entry.table[keep:]
        del entry.table[keep:]
        entry.reserved_tokens = min(entry.reserved_tokens, num_tokens)
        for block_id in reversed(extra):
            self._decref(block_id)
        return len(extra)

    def release(self, seq_id: str) -> int:
        """Drops the sequence's table and any swapped-out KV it holds. Blocks reaching ref 0
        become free (or evictable when cached).

        Blocks are released last-first, so a sequence's tail is evicted before its prefix.
        """
        if seq_id in self._swapped or self._swap_outs or self._swap_ins:
            self._drop_swap(seq_id)
        return self._drop_table(seq_id)

    # ---- helpers -------------------------------------------------------
    def _drop_swap(self, seq_id: str) -> None:
        """Forgets `seq_id`'s swap: held in the tier, or still queued to be copied out or in."""
        self._swapped.pop(seq_id, None)
        self._swap_outs = [move for move in self._swap_outs if move[0] != seq_id]
        self._swap_ins = [move for move in self._swap_ins if move[0] != seq_id]
        if self.host_tier is not None:
            self.host_tier.drop_swap(seq_id)

    def _drop_table(self, seq_id: str) -> int:
        entry = self._seqs.pop(seq_id, None)
        if entry is None:
            return 0
        for block_id in reversed(entry.table):
            self._decref(block_id)
        return len(entry.table)

    def _restore_into(self, entry: _SeqBlocks, host_blocks: tuple[tuple[int, tuple], ...]) -> tuple[int, int]:
        """Appends fresh blocks for the host-tier blocks that pass the tier's check (in order,
        up to the first that fails) and queues their restores; returns how many, and how many of
        those the shared tier had loaded."""
        start, restored, shared = perf_counter(), 0, 0
        for h, key in host_blocks:
            if h in self._cached:
                break  # also in the pool again (recomputed while its old copy was stored): the pool's wins
            held = self.host_tier.take_entry(h, key)
            if held is None:
                break  # missing or failed its check: recomputed from here
            data, shared = self.host_tier.full_bytes(held), shared + (held.origin == "shared")
            block_id = self._take_free_block()
            block = self._blocks[block_id]
            block.hash, block.key, block.index = h, key, len(entry.table)
            self._cached[h] = block_id
            self._events.append(KVEvent("stored", h, key[0], len(key[1]), _scope(key[2])))
            self._restores.append((block_id, data))
            entry.table.append(block_id)
            entry.hashes.append(h)
            restored += 1
        self.host_tier.add_time(restore_s=perf_counter() - start)
        return restored, shared

    def _missing(self, seq_id: str, num_tokens: int) -> int:
        """Blocks `reserve(seq_id, num_tokens)` takes: new ones, plus a copy-on-write copy."""
        entry = self._seqs.get(seq_id)
        have = len(entry.table) if entry else 0
        cow = 1 if entry is not None and self._shared_tail(entry, num_tokens) is not None else 0
        return max(0, self.blocks_for(num_tokens) - have) + cow

    def _shared_tail(self, entry: _SeqBlocks, num_tokens: int) -> int | None:
        """The partial last block growing to `num_tokens` writes into, if another sequence shares it."""
        filled = entry.reserved_tokens
        if num_tokens <= filled or filled % self.block_size == 0:
            return None  # no growth, or the growth starts a fresh block
        block_id = entry.table[filled // self.block_size]
        return block_id if self._blocks[block_id].ref_count > 1 else None

    def _decref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def _acquire(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently used
            block = self._blocks[block_id]
            del self._cached[block.hash]
            parent, tokens, extra_key = block.key
            if self.host_tier is not None:  # its KV is still in place until the next forward pass
                self._stores.append((block_id, block.hash, block.key, block.index * self.block_size))
            self._events.append(KVEvent("removed", block.hash, parent, len(tokens), _scope(extra_key)))
            block.hash = block.key = None
            self._evictions += 1
        self._blocks[block_id].ref_count = 1
        return block_id


def tier_event(kind: str, tier: str, block_hash: int, key: tuple) -> KVEvent:
    """A change of what the host or shared tier holds (`HostTier.on_event`, `SharedTier.on_event`),
    for the same subscribers as the pool's own events."""
    parent, tokens, extra_key = key
    return KVEvent(kind, block_hash, parent, len(tokens), _scope(extra_key), tier)


def _scope(extra_key: str) -> str:
    return hashlib.blake2b(extra_key.encode(), digest_size=6).hexdigest()
