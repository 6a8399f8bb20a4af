"""The target's features of cached prefix blocks, kept for later sequences that reuse the blocks (EAGLE).

A sequence whose prompt starts with cached KV blocks computes no feature for the cached
positions, so without these its head context would start after them (weaker drafts: on the
eagle chi-square test's repeated prompt 1 of 179 draft tokens was accepted against 46 of 155
without caching). `PrefixFeatures` is the one owner of features kept past the sequence that
computed them:

- `collect` takes a speculating sequence's committed features as they are computed (the same
  rows `FeatureBuffer` sends) and holds the run not yet in a full hashed block;
- `seal` stores the run's full blocks under the chained hashes the block manager gave them
  (`BlockManager.prefix_hashes`: tokens and extra key, so tenants never share features, as
  they never share blocks); a block's features depend only on its prefix, which its hash names;
- `held` says how many leading blocks of a prefix have features: a speculating sequence reuses
  only those cached blocks (the scheduler's `prefix_limit`) and recomputes the rest, so its head
  sees its whole context; `prefix` returns them for its first draft call.

Bounded by bytes, least recently used first out; bf16 rows (the wire's precision).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from services.target.speculation.features import FeatureBuffer


class PrefixFeatures:
    def __init__(self, block_size: int, capacity_bytes: int) -> None:
        if block_size <= 0 or capacity_bytes < 0:
            raise ValueError(f"block_size must be > 0 and capacity_bytes >= 0, got {block_size}, {capacity_bytes}")
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()  # hash -> [block_size, hidden] bf16; LRU first
        self._open = FeatureBuffer()  # per sequence: the run of rows not yet sealed, from a block boundary

    def collect(self, seq_id: str, start: int, rows: torch.Tensor) -> None:
        """rows [m, hidden]: the sequence's features of positions start .. start + m - 1. A run
        that does not continue the open one replaces it; one that starts inside a block waits
        for the next block boundary (its first block cannot be completed)."""
        if not self.capacity_bytes or not len(rows):
            return
        skip = 0 if self._open.end(seq_id) == start else -start % self.block_size
        if skip < len(rows):
            self._open.add(seq_id, start + skip, rows[skip:].detach().to(torch.bfloat16))
        else:
            self._open.drop(seq_id)

    def seal(self, seq_id: str, hashes: Sequence[int]) -> None:
        """Stores the open run's full blocks that have a hash (hashes[i]: the sequence's block i)."""
        taken = self._open.take(seq_id)
        if taken is None:
            return
        start, rows = taken  # rows [m, hidden] from a block boundary
        first = start // self.block_size
        done = max(first, min(len(hashes), (start + len(rows)) // self.block_size))  # blocks sealed up to here
        for b in range(first, done):
            self._store(hashes[b], rows[(b - first) * self.block_size:(b - first + 1) * self.block_size])
        self._open.add(seq_id, done * self.block_size, rows[(done - first) * self.block_size:])  # the rest, if any

    def held(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` have their features here."""
        n = 0
        while n < len(hashes) and hashes[n] in self._blocks:
            n += 1
        return n

    def prefix(self, hashes: Sequence[int]) -> torch.Tensor | None:
        """[len(hashes) * block_size, hidden] bf16: the features of those blocks in order (most
        recently used now), or None if any is missing."""
        if not hashes or self.held(hashes) < len(hashes):
            return None
        for h in hashes:
            self._blocks.move_to_end(h)
        return torch.cat([self._blocks[h] for h in hashes])

    def drop(self, seq_id: str) -> None:
        self._open.drop(seq_id)

    def __len__(self) -> int:
        return len(self._blocks)

    def _store(self, block_hash: int, rows: torch.Tensor) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        size = rows.numel() * rows.element_size()
        if size > self.capacity_bytes:
            return
        while self.num_bytes + size > self.capacity_bytes:
            _, old = self._blocks.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
        self._blocks[block_hash] = rows.clone()  # not a view of the run: the run's tensor is freed
        self.num_bytes += size
