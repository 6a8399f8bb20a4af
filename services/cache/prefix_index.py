"""Prefix index: which target replica holds which cached KV block (by chained hash).

Built only from the replicas' KV events (services/target/engine/kv_events.py): a snapshot
replaces a replica's whole set, then `stored` / `removed` events edit it. The index
never holds KV tensors, only 64-bit block hashes. One owner: the subscribers
(services/cache/kv_subscriber.py) write, `match` reads; all on one event loop.

The replicas followed may change (replicas found by DNS, services/cache/kv_subscriber.py):
`track` adds one (holding nothing, not synced), `drop` removes one and all it held.

A replica is *synced* once a snapshot arrived on its current connection; until then
(and after it disconnects) it holds nothing and `match` reports it as not synced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

STORED, REMOVED = "stored", "removed"


@dataclass(frozen=True)
class ReplicaMatch:
    replica: str
    matched_blocks: int  # leading blocks of the query the replica holds
    synced: bool


class PrefixIndex:
    def __init__(self, replicas: Sequence[str]) -> None:
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"replicas must be distinct, got {list(replicas)}")
        self.replicas = tuple(replicas)
        self._blocks: dict[str, set[int]] = {r: set() for r in self.replicas}
        self._synced: dict[str, bool] = {r: False for r in self.replicas}
        self.events_applied = 0
        self.resyncs = 0

    # ---- reads ----------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int], replicas: Sequence[str] = ()) -> list[ReplicaMatch]:
        """Leading blocks of `block_hashes` each replica holds (all replicas when empty).

        A replica the index does not know answers 0, not synced.
        """
        out = []
        for replica in replicas or self.replicas:
            held = self._blocks.get(replica)
            if held is None or not self._synced[replica]:
                out.append(ReplicaMatch(replica, 0, False))
                continue
            n = 0
            for h in block_hashes:
                if h not in held:
                    break
                n += 1
            out.append(ReplicaMatch(replica, n, True))
        return out

    def blocks(self, replica: str) -> frozenset[int]:
        return frozenset(self._blocks[replica])

    def is_synced(self, replica: str) -> bool:
        return self._synced[replica]

    @property
    def size(self) -> int:
        """(replica, block) entries held."""
        return sum(len(b) for b in self._blocks.values())

    # ---- writes (subscribers only) -----------------------------------------------------------

    def apply_snapshot(self, replica: str, block_hashes: Iterable[int]) -> None:
        """Replaces everything known about `replica` with its snapshot."""
        self._blocks[replica] = set(block_hashes)
        self._synced[replica] = True
        self.resyncs += 1

    def apply_event(self, replica: str, kind: str, block_hash: int) -> None:
        if kind == STORED:
            self._blocks[replica].add(block_hash)
        elif kind == REMOVED:
            self._blocks[replica].discard(block_hash)
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")
        self.events_applied += 1

    def forget(self, replica: str) -> None:
        """The replica's connection is gone: its contents are unknown until the next snapshot."""
        if replica in self._blocks:
            self._blocks[replica] = set()
            self._synced[replica] = False

    def track(self, replica: str) -> None:
        """Follow one more replica (it holds nothing until its snapshot)."""
        if replica not in self._blocks:
            self.replicas += (replica,)
            self._blocks[replica], self._synced[replica] = set(), False

    def drop(self, replica: str) -> None:
        """The replica is gone (left DNS): forget it and everything it held."""
        self.replicas = tuple(r for r in self.replicas if r != replica)
        self._blocks.pop(replica, None)
        self._synced.pop(replica, None)
