"""Suffix decoding: propose the most frequent continuations of the longest matching suffix,
as a tree, from the sequence's own history and its tenant's recent outputs.

Corpus of a sequence: its own committed tokens (prompt + output so far) and the outputs
of this tenant's released sequences (per `tenant_salt`; text never crosses tenants).

Per proposal:
1. match: the longest suffix of the history (at most `max_match` tokens) that occurs
   earlier in the corpus with at least one token after it; every occurrence of exactly
   that suffix counts (at most `max_occurrences`, most recent first: own history, then
   the tenant's outputs from newest to oldest);
2. tree: the continuations after the occurrences form a trie whose node counts are the
   number of occurrences passing through it. Nodes are taken best-first by count (ties:
   shallower first, then by token ids along the path) until `max_nodes` nodes are taken
   or nothing is left; no node is deeper than `max_depth`. A node's count never exceeds
   its parent's, so parents come before children and the tree is closed under parents.

Memory: each tenant keeps at most `tenant_max_tokens` output tokens (oldest outputs are
dropped first; an output longer than the cap keeps its last tokens) and at most
`max_tenants` tenants are kept (least recently used dropped first). Each open sequence
keeps a copy of its own output until release.

Cost: one vectorized scan of the corpus per proposal (O(corpus) numpy work), then
O(max_match) filtering steps over the occurrences of the last token.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.draft.proposers.base import ROOT, DraftTree, Proposer
from services.draft.state import SequenceState

_SEPARATOR = -1  # between outputs in a tenant corpus; never equals a token id


class SuffixProposer(Proposer):
    def __init__(self, max_match: int = 32, tenant_max_tokens: int = 65536, max_tenants: int = 1024,
                 max_occurrences: int = 256) -> None:
        for name, value in (("max_match", max_match), ("tenant_max_tokens", tenant_max_tokens),
                            ("max_tenants", max_tenants), ("max_occurrences", max_occurrences)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_match = max_match
        self.tenant_max_tokens = tenant_max_tokens
        self.max_tenants = max_tenants
        self.max_occurrences = max_occurrences
        self._sequences: dict[str, _SequenceRecord] = {}
        self._tenants: OrderedDict[str, TenantCorpus] = OrderedDict()  # least recently used first

    def propose(self, states: Sequence[SequenceState], max_depth: int, max_nodes: int) -> list[DraftTree]:
        if max_depth < 1 or max_nodes < 1:
            raise ValueError(f"max_depth and max_nodes must be >= 1, got {max_depth}, {max_nodes}")
        return [self._tree(state, max_depth, max_nodes) for state in states]

    def propose_batch(self, states: Sequence[SequenceState], max_depths: Sequence[int],
                      max_nodes: Sequence[int]) -> list[DraftTree]:
        return [self.propose([state], depth, nodes)[0]
                for state, depth, nodes in zip(states, max_depths, max_nodes, strict=True)]

    def observe(self, sequence_id: str, new_token_ids: Sequence[int]) -> None:
        record = self._sequences.get(sequence_id)
        if record is None:  # the first call carries the prompt
            self._sequences[sequence_id] = _SequenceRecord(num_tokens=len(new_token_ids))
            return
        record.output.extend(new_token_ids)
        record.num_tokens += len(new_token_ids)

    def release(self, sequence_id: str) -> None:
        """Drops the sequence; its output joins its tenant's corpus."""
        record = self._sequences.pop(sequence_id, None)
        if record is not None and record.tenant_salt is not None and len(record.output):
            self._tenant(record.tenant_salt).add(np.array(record.output, dtype=np.int32))

    def tenant_num_tokens(self, tenant_salt: str) -> int:
        """Output tokens kept for the tenant (0 when unknown)."""
        corpus = self._tenants.get(tenant_salt)
        return 0 if corpus is None else corpus.num_tokens

    # ---- helpers ------------------------------------------------------------------------

    def _tree(self, state: SequenceState, max_depth: int, max_nodes: int) -> DraftTree:
        record = self._sequences.get(state.sequence_id)
        if record is None or record.num_tokens != state.num_tokens:
            seen = 0 if record is None else record.num_tokens
            raise RuntimeError(f"suffix record of {state.sequence_id!r} has {seen} tokens, "
                               f"history has {state.num_tokens}: observe() was skipped")
        if record.tenant_salt is None:
            record.tenant_salt = state.tenant_salt
        elif record.tenant_salt != state.tenant_salt:
            raise RuntimeError(f"sequence {state.sequence_id!r} changed tenant")
        history = np.array(state.token_ids, dtype=np.int32)  # [num_tokens], a copy
        sources = [history]
        corpus = self._tenants.get(state.tenant_salt)
        if corpus is not None:
            self._tenants.move_to_end(state.tenant_salt)
            sources.append(corpus.flat())
        continuations = self._continuations(history, sources, max_depth)  # [num_occurrences, max_depth]
        token_ids, parents = best_first_tree(continuations, max_nodes)
        return DraftTree.from_nodes(state.sequence_id, token_ids, parents)

    def _continuations(self, history: np.ndarray, sources: list[np.ndarray], max_depth: int) -> np.ndarray:
        """Tokens after each occurrence of the longest matching suffix of `history`, -1 padded."""
        suffix = history[-self.max_match:]  # [<= max_match]
        found = [(source, *_match_ends(source, suffix)) for source in sources]
        best = max((int(lengths.max()) for _, _, lengths in found if lengths.size), default=0)
        rows: list[np.ndarray] = []
        budget = self.max_occurrences
        for source, ends, lengths in found:  # most recent source first
            ends = ends[lengths == best][::-1][:budget]  # most recent first
            budget -= len(ends)
            if len(ends):
                rows.append(_following(source, ends, max_depth))
        if not rows:
            return np.empty((0, max_depth), dtype=np.int32)
        return np.concatenate(rows)

    def _tenant(self, tenant_salt: str) -> TenantCorpus:
        corpus = self._tenants.get(tenant_salt)
        if corpus is None:
            corpus = self._tenants[tenant_salt] = TenantCorpus(self.tenant_max_tokens)
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        self._tenants.move_to_end(tenant_salt)
        return corpus


class TenantCorpus:
    """One tenant's recent outputs, oldest first, at most `max_tokens` tokens in all."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._outputs: deque[np.ndarray] = deque()
        self._flat: np.ndarray | None = None

    def add(self, output: np.ndarray) -> None:  # output: [num_tokens] int32
        output = output[-self.max_tokens:]
        self._outputs.append(output)
        self.num_tokens += len(output)
        while self.num_tokens > self.max_tokens:
            self.num_tokens -= len(self._outputs.popleft())
        self._flat = None

    def flat(self) -> np.ndarray:
        """All outputs, oldest first, each followed by a -1 separator."""  # [num_tokens + num_outputs]
        if self._flat is None:
            parts = []
            for output in self._outputs:
                parts += [output, np.array([_SEPARATOR], dtype=np.int32)]
            self._flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
        return self._flat


def best_first_tree(continuations: np.ndarray, max_nodes: int) -> tuple[list[int], list[int]]:
    """Flat (token_ids, parents) of the `max_nodes` most frequent trie nodes over the rows
    of `continuations` ([num_rows, max_depth] int32, -1 after a row ends)."""
    token_ids: list[int] = []
    parents: list[int] = []
    max_depth = continuations.shape[1]
    heap: list = []
    _push_children(heap, continuations, np.arange(len(continuations)), 0, (), ROOT)
    while heap and len(token_ids) < max_nodes:
        _, depth, path, parent, rows = heapq.heappop(heap)
        token_ids.append(path[-1])
        parents.append(parent)
        if depth < max_depth:
            _push_children(heap, continuations, rows, depth, path, len(token_ids) - 1)
    return token_ids, parents


# ---- helpers ----------------------------------------------------------------------------


@dataclass
class _SequenceRecord:
    num_tokens: int  # committed tokens observed
    tenant_salt: str | None = None  # known from the first proposal
    output: array = field(default_factory=lambda: array("i"))  # committed tokens after the prompt


def _match_ends(source: np.ndarray, suffix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """End positions e in `source` where a suffix of `suffix` ends with at least one token
    after it, and the length of the longest such suffix at each e."""
    if len(source) < 2 or len(suffix) == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(source[:-1] == suffix[-1])  # [num_ends]
    ends = ends[source[ends + 1] != _SEPARATOR]
    lengths = np.ones(len(ends), dtype=np.int64)  # [num_ends]
    active = np.ones(len(ends), dtype=bool)
    for j in range(1, len(suffix)):
        idx = ends - j
        active &= idx >= 0
        active[active] = source[idx[active]] == suffix[-1 - j]
        if not active.any():
            break
        lengths += active
    return ends, lengths


def _following(source: np.ndarray, ends: np.ndarray, max_depth: int) -> np.ndarray:
    """[len(ends), max_depth] tokens after each end, -1 from a separator or the end on."""
    idx = ends[:, None] + 1 + np.arange(max_depth)  # [num_ends, max_depth]
    inside = idx < len(source)
    tokens = np.where(inside, source[np.minimum(idx, len(source) - 1)], _SEPARATOR)
    return np.where(np.cumsum(tokens == _SEPARATOR, axis=1) > 0, _SEPARATOR, tokens).astype(np.int32)


def _push_children(heap: list, continuations: np.ndarray, rows: np.ndarray, depth: int,
                   path: tuple[int, ...], parent: int) -> None:
    """Pushes the children (next tokens at column `depth`) of the node of `rows`."""
    values = continuations[rows, depth]  # [num_rows]
    keep = values != _SEPARATOR
    rows, values = rows[keep], values[keep]
    if not len(rows):
        return
    tokens, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    groups = np.split(rows[order], np.cumsum(counts)[:-1])
    for token, count, child_rows in zip(tokens.tolist(), counts.tolist(), groups):
        child_path = path + (token,)
        heapq.heappush(heap, (-count, depth + 1, child_path, parent, child_rows))
