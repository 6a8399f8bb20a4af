"""Prompt lookup: propose the tokens that followed the last earlier occurrence of the
sequence's last n tokens (like transformers' `prompt_lookup_num_tokens` and vLLM's
n-gram proposer).

For n from `max_ngram` down to `min_ngram`, the most recent earlier occurrence of the
last n committed tokens wins, and up to `max_depth` tokens that followed it are proposed
as a chain. Longer n-grams are tried first; no match for any n means an empty proposal.

Cost: each sequence keeps an index per n (n-gram -> start of its most recent occurrence
that has a following token), updated in `observe` with vectorized work per appended
batch, so a lookup is O(max_ngram) dict probes however long the sequence is. Memory is
about 3 dict entries per committed token and n.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from services.draft.proposers.base import DraftTree, Proposer
from services.draft.state import SequenceState


class PromptLookupProposer(Proposer):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                             f"max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, states: Sequence[SequenceState], max_depth: int, max_nodes: int) -> list[DraftTree]:
        if max_depth < 1 or max_nodes < 1:
            raise ValueError(f"max_depth and max_nodes must be >= 1, got {max_depth}, {max_nodes}")
        num_tokens = min(max_depth, max_nodes)  # a chain has one node per depth
        return [DraftTree.chain(state.sequence_id, self._continuation(state, num_tokens))
                for state in states]

    def observe(self, sequence_id: str, new_token_ids: Sequence[int]) -> None:
        index = self._indexes.get(sequence_id)
        if index is None:
            index = self._indexes[sequence_id] = _NgramIndex(self.min_ngram, self.max_ngram)
        index.extend(new_token_ids)

    def release(self, sequence_id: str) -> None:
        self._indexes.pop(sequence_id, None)

    def _continuation(self, state: SequenceState, num_tokens: int) -> list[int]:
        index = self._indexes.get(state.sequence_id)
        if index is None or index.num_tokens != state.num_tokens:
            seen = 0 if index is None else index.num_tokens
            raise RuntimeError(f"prompt lookup index of {state.sequence_id!r} has {seen} tokens, "
                               f"history has {state.num_tokens}: observe() was skipped")
        start = index.match_end(state.token_ids)
        if start is None:
            return []
        return state.token_ids[start:start + num_tokens].tolist()


class _NgramIndex:
    """Per n: n-gram (as int32 bytes) -> start of its most recent occurrence that is
    followed by at least one committed token. Kept in sync with one history by `extend`."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.num_tokens = 0
        self._last_start: dict[int, dict[bytes, int]] = {
            n: {} for n in range(max_ngram, min_ngram - 1, -1)}  # longest n first
        self._tail = np.empty(0, dtype=np.int32)  # [<= max_ngram] last committed tokens

    def extend(self, new_token_ids: Sequence[int]) -> None:
        new = np.asarray(new_token_ids, dtype=np.int32)  # [num_new]
        if new.size == 0:
            return
        window = np.concatenate([self._tail, new])  # [len(tail) + num_new]
        offset = self.num_tokens - len(self._tail)  # history position of window[0]
        old_len, new_len = self.num_tokens, self.num_tokens + len(new)
        for n, table in self._last_start.items():
            # Starts p that just got a following token: old_len <= p + n < new_len.
            first, end = max(0, old_len - n), new_len - n
            if end <= first:
                continue
            rows = sliding_window_view(window, n)[first - offset:end - offset]  # [m, n]
            keys = np.ascontiguousarray(rows).view(np.dtype((np.void, 4 * n))).ravel().tolist()
            table.update(zip(keys, range(first, end)))  # later starts overwrite earlier ones
        self._tail = window[-self.max_ngram:].copy()
        self.num_tokens = new_len

    def match_end(self, history: array) -> int | None:
        """Position right after the most recent earlier occurrence of the longest
        matching suffix of `history` (int32 array of `num_tokens`), or None."""
        for n, table in self._last_start.items():
            if len(history) <= n:
                continue
            start = table.get(history[-n:].tobytes())
            if start is not None:
                return start + n
        return None
