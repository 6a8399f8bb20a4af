"""What one sequence contributes to a forward pass (a prefill chunk, a decode step or a tree)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepInput:
    seq_id: str
    token_ids: list[int]  # [q_len] tokens whose KV is computed this step
    positions: list[int]  # [q_len] absolute positions (tree nodes: context_len + depth)
    context_len: int  # KV entries before these tokens; they occupy indices context_len..+q_len-1
    num_logits: int  # logits wanted for the last `num_logits` tokens (0, 1, or q_len for trees)
    parents: list[int] | None = None  # [q_len] tree: parent index within this input, -1 for row 0

    @classmethod
    def chunk(cls, seq_id: str, token_ids: list[int], start: int, samples: bool) -> "StepInput":
        return cls(seq_id, token_ids, list(range(start, start + len(token_ids))), start, int(samples))

    @classmethod
    def tree(cls, seq_id: str, root_token: int, context_len: int, draft_tokens: list[int],
             draft_parents: list[int], draft_depths: list[int]) -> "StepInput":
        """Root (the pending committed token) plus draft nodes; node i of the draft is row i + 1."""
        return cls(seq_id, [root_token, *draft_tokens],
                   [context_len, *(context_len + d for d in draft_depths)], context_len,
                   1 + len(draft_tokens), [-1, *(p + 1 for p in draft_parents)])


def split_logits(logits, inputs: list[StepInput]) -> list:
    """logits: [sum(num_logits), vocab] of a forward pass -> one [num_logits, vocab] view per input."""
    rows, offset = [], 0
    for inp in inputs:
        rows.append(logits[offset:offset + inp.num_logits])
        offset += inp.num_logits
    return rows
