"""Prefix index: which target replica holds which cached KV block (by chained hash).

Built only from the replicas' KV events (services/target/engine/kv_events.py): a snapshot
replaces a replica's whole set, then `stored` / `removed` events edit it. The index
never holds KV tensors, only 64-bit block hashes. One owner: the subscribers
(services/cache/kv_subscriber.py) write, `match` reads; all on one event loop.

The replicas followed may change (replicas found by DNS, services/cache/kv_subscriber.py):
`track` adds one (holding nothing, not synced), `drop` removes one and all it held.

A replica is *synced* once a snapshot arrived on its current connection; until then
(and after it disconnects) it holds nothing and `match` reports it as not synced.

Tiers: each replica's blocks are kept per tier, as its events name them: `device` (its KV
pool), `host` (its host tier) and `shared` (entries it wrote to the shared tier, which every
replica with a shared tier can load). `match` follows the target's own order (block_manager
`match_prefix`, then shared_tier `prefetch`): the pool's leading run, then the host tier's,
then the shared store's. Shared entries that expire in Redis are not told: the index may
count some a replica would then recompute (a price, never a wrong token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

STORED, REMOVED = "stored", "removed"
DEVICE, HOST, SHARED = "device", "host", "shared"
TIERS = (DEVICE, HOST, SHARED)


@dataclass(frozen=True)
class ReplicaMatch:
    replica: str
    matched_blocks: int  # leading blocks of the query the replica holds in its pool
    synced: bool
    host_blocks: int = 0  # the blocks right after those, held by its host tier
    shared_blocks: int = 0  # the blocks right after those, held by the shared tier (any replica's)


class PrefixIndex:
    def __init__(self, replicas: Sequence[str]) -> None:
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"replicas must be distinct, got {list(replicas)}")
        self.replicas = tuple(replicas)
        self._blocks: dict[str, dict[str, set[int]]] = {r: _empty() for r in self.replicas}  # replica -> tier -> hashes
        self._synced: dict[str, bool] = {r: False for r in self.replicas}
        self.events_applied = 0
        self.resyncs = 0

    # ---- reads ----------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int], replicas: Sequence[str] = ()) -> list[ReplicaMatch]:
        """Leading blocks of `block_hashes` each replica holds (all replicas when empty).

        A replica the index does not know answers 0, not synced.
        """
        out, shared = [], None
        for replica in replicas or self.replicas:
            held = self._blocks.get(replica)
            if held is None or not self._synced[replica]:
                out.append(ReplicaMatch(replica, 0, False))
                continue
            device = _run(block_hashes, 0, held[DEVICE])
            host = _run(block_hashes, device, held[HOST])
            if shared is None:
                shared = set().union(*(b[SHARED] for b in self._blocks.values()))
            out.append(ReplicaMatch(replica, device, True, host,
                                    _run(block_hashes, device + host, shared)))
        return out

    def blocks(self, replica: str, tier: str = DEVICE) -> frozenset[int]:
        return frozenset(self._blocks[replica][tier])

    def is_synced(self, replica: str) -> bool:
        return self._synced[replica]

    @property
    def size(self) -> int:
        """(replica, block) entries held."""
        return sum(len(held) for tiers in self._blocks.values() for held in tiers.values())

    # ---- writes (subscribers only) -----------------------------------------------------------

    def apply_snapshot(self, replica: str, block_hashes: Iterable[int | tuple[int, str]]) -> None:
        """Replaces everything known about `replica` with its snapshot: block hashes (of its pool)
        or (hash, tier) pairs."""
        tiers = _empty()
        for block in block_hashes:
            h, tier = block if isinstance(block, tuple) else (block, DEVICE)
            tiers[tier].add(h)
        self._blocks[replica] = tiers
        self._synced[replica] = True
        self.resyncs += 1

    def apply_event(self, replica: str, kind: str, block_hash: int, tier: str = DEVICE) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown KV tier {tier!r}")
        if kind == STORED:
            self._blocks[replica][tier].add(block_hash)
        elif kind == REMOVED:
            self._blocks[replica][tier].discard(block_hash)
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")
        self.events_applied += 1

    def forget(self, replica: str) -> None:
        """The replica's connection is gone: its contents are unknown until the next snapshot."""
        if replica in self._blocks:
            self._blocks[replica] = _empty()
            self._synced[replica] = False

    def track(self, replica: str) -> None:
        """Follow one more replica (it holds nothing until its snapshot)."""
        if replica not in self._blocks:
            self.replicas += (replica,)
            self._blocks[replica], self._synced[replica] = _empty(), False

    def drop(self, replica: str) -> None:
        """The replica is gone (left DNS): forget it and everything it held."""
        self.replicas = tuple(r for r in self.replicas if r != replica)
        self._blocks.pop(replica, None)
        self._synced.pop(replica, None)


def _empty() -> dict[str, set[int]]:
    return {tier: set() for tier in TIERS}


def _run(block_hashes: Sequence[int], start: int, held: set[int]) -> int:
    """How many of `block_hashes` from `start` on are in `held`, without a gap."""
    n = 0
    for h in block_hashes[start:]:
        if h not in held:
            break
        n += 1
    return n
