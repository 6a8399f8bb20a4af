"""What one forward pass computes, as plain host lists: the one message a tensor-parallel target's
rank 0 sends its other ranks per step (services/target/tp/), and what every rank's
ModelRunner.execute runs.

A plan carries no sequence ids: the block manager (rank 0 only) has already turned sequences into
slots and block tables, so every rank reads and writes the same block ids of its own KV shard.
It also carries the KV copies rank 0 made since the previous plan (copy-on-write blocks, an
accepted tree path's slots), in order: a rank runs them before the forward, where rank 0 ran them.

Encoding: one flat int64 tensor, a header then the lists:
  [length, kind, T, R, S, W, has_tree, num_copies,
   token_ids[T], positions[T], slots[T], logit_rows[R], q_lens[S], context_lens[S],
   block_tables[S * W] (-1 padded), parents[T] (has_tree only),
   per copy: kind, n, src[n], dst[n]]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STEP, STOP = 0, 1  # message kinds
BLOCKS, SLOTS = 0, 1  # KV copy kinds: whole blocks by block id, single entries by slot id
_HEADER = 8


@dataclass(frozen=True)
class KVCopy:
    """KV entries copied within every layer of the pool: src[i] -> dst[i] (all read before any write)."""

    kind: int  # BLOCKS or SLOTS
    src: list[int]
    dst: list[int]


@dataclass
class StepPlan:
    token_ids: list[int]  # [T]
    positions: list[int]  # [T] absolute positions (tree nodes: context_len + depth)
    slots: list[int]  # [T] KV slot of each token
    logit_rows: list[int]  # [R] rows whose logits are wanted
    q_lens: list[int]  # [S] tokens per sequence
    context_lens: list[int]  # [S] KV entries before this step's tokens
    block_tables: list[list[int]]  # [S][blocks of the sequence]
    parents: list[int] | None = None  # [T] parent within its sequence (-1: first row); chunks as chains; None: no tree
    copies: list[KVCopy] = field(default_factory=list)  # KV copies to run before the forward, in order

    def encode(self) -> torch.Tensor:  # -> [length] int64
        width = max((len(t) for t in self.block_tables), default=0)
        body = [*self.token_ids, *self.positions, *self.slots, *self.logit_rows, *self.q_lens, *self.context_lens]
        for table in self.block_tables:
            body.extend([*table, *[-1] * (width - len(table))])
        if self.parents is not None:
            body.extend(self.parents)
        for copy in self.copies:
            body.extend([copy.kind, len(copy.src), *copy.src, *copy.dst])
        header = [0, STEP, len(self.token_ids), len(self.logit_rows), len(self.q_lens), width,
                  int(self.parents is not None), len(self.copies)]
        message = torch.tensor([*header, *body], dtype=torch.int64)
        message[0] = len(message)
        return message

    @classmethod
    def decode(cls, message: torch.Tensor) -> "StepPlan":  # [length] int64
        values = message.tolist()
        _, kind, t, r, s, w, has_tree, num_copies = values[:_HEADER]
        if kind != STEP:
            raise ValueError(f"not a step plan (kind {kind})")
        at = _HEADER

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return values[at - n:at]
        ids, positions, slots, rows, q_lens, ctx = take(t), take(t), take(t), take(r), take(s), take(s)
        tables = [[b for b in take(w) if b >= 0] for _ in range(s)]
        parents = take(t) if has_tree else None
        copies = []
        for _ in range(num_copies):
            copy_kind, n = take(2)
            copies.append(KVCopy(copy_kind, take(n), take(n)))
        return cls(ids, positions, slots, rows, q_lens, ctx, tables, parents, copies)


def stop_message() -> torch.Tensor:  # [HEADER] int64: the ranks leave their loop
    return torch.tensor([_HEADER, STOP, 0, 0, 0, 0, 0, 0], dtype=torch.int64)


def message_kind(message: torch.Tensor) -> int:
    return int(message[1])


def tree_mask(q_lens: list[int], parents: list[int] | None, device: torch.device | str) -> torch.Tensor | None:
    """[num_tokens, max_q_len] bool on `device`: each row's ancestors and itself within its sequence
    (a chunk's chain of parents gives the causal mask); None without a tree (host lists, one copy)."""
    if parents is None:
        return None
    width = max(q_lens)
    rows: list[list[bool]] = []
    start = 0
    for n in q_lens:
        mask: list[list[bool]] = []
        for i, parent in enumerate(parents[start:start + n]):
            row = list(mask[parent]) if parent >= 0 else [False] * n
            row[i] = True
            mask.append(row)
        rows.extend(row + [False] * (width - n) for row in mask)
        start += n
    return torch.tensor(rows, dtype=torch.bool, device=device)
