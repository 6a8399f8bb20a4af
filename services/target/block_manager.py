"""The one owner of KV blocks: free list, reference counts and per-sequence block tables.

Everything else asks this module for blocks and never edits a table itself.
Check, then commit: `can_reserve` before `reserve`; a reserve that cannot be
satisfied raises `OutOfBlocks` and changes nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks for the request; nothing was allocated."""


@dataclass(frozen=True)
class BlockStats:
    num_blocks: int
    free_blocks: int
    used_blocks: int
    allocated_slots: int  # slots in used blocks
    used_slots: int  # slots holding a token that a sequence reserved


class BlockManager:
    """Fixed-size KV blocks for all sequences of one engine.

    A sequence's table maps its token index i to slot
    `table[i // block_size] * block_size + i % block_size`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))  # lowest ids first
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._reserved_tokens: dict[str, int] = {}

    # ---- queries -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def can_reserve(self, seq_id: str, num_tokens: int) -> bool:
        return self._missing_blocks(seq_id, num_tokens) <= len(self._free)

    def slot(self, seq_id: str, index: int) -> int:
        table = self._tables[seq_id]
        return table[index // self.block_size] * self.block_size + index % self.block_size

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        table, bs = self._tables[seq_id], self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def stats(self) -> BlockStats:
        used = self.num_blocks - len(self._free)
        return BlockStats(self.num_blocks, len(self._free), used, used * self.block_size,
                          sum(self._reserved_tokens.values()))

    # ---- changes -------------------------------------------------------
    def reserve(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grows `seq_id`'s table to hold `num_tokens` tokens; returns the new block ids."""
        missing = self._missing_blocks(seq_id, num_tokens)
        if missing > len(self._free):
            raise OutOfBlocks(f"{seq_id}: need {missing} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        new = [self._free.popleft() for _ in range(missing)]
        for block_id in new:
            self._ref_counts[block_id] = 1
        table.extend(new)
        self._reserved_tokens[seq_id] = max(self._reserved_tokens.get(seq_id, 0), num_tokens)
        return new

    def release(self, seq_id: str) -> int:
        """Drops the sequence's table; blocks whose count reaches 0 go back to the free list."""
        table = self._tables.pop(seq_id, [])
        self._reserved_tokens.pop(seq_id, None)
        for block_id in table:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
        return len(table)

    # ---- helpers -------------------------------------------------------
    def _missing_blocks(self, seq_id: str, num_tokens: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)
