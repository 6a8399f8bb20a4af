"""EAGLE proposer: the feature head's drafts for sequences whose target sends features.

Per sequence (`_SequenceHead`) it keeps the head context (services/draft/eagle/drafter.py)
and the true features not yet fed. The service calls, per request and in this order:
`observe` (new committed tokens), `add_features` (the target's features of newly committed
positions), `set_sampling`, then `propose_batch`.

Feature j (the target's last-layer feature at position j) is fed with token j + 1, so after
n committed tokens the head can hold positions up to n - 2 (the newest token's feature is
computed by the next verify pass). A sequence drafts only when its context reaches position
n - 2; otherwise (features lost on the wire, a draft restart, a target without a lean forward)
it gets an empty tree and that step decodes plainly. A plan whose node budget exceeds its depth
gets EAGLE-2 trees (sampled requests too, their nodes sent without q: deterministic proposals);
otherwise chains, a sampled request's nodes carrying their sparse q.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.draft.eagle.checkpoint import load_head
from services.draft.eagle.drafter import HeadContext, HeadDrafter
from services.draft.eagle.target_parts import TargetParts
from services.draft.proposers.base import DraftSampling, DraftTree, Proposer
from services.draft.state import SequenceState

log = logging.getLogger(__name__)


@dataclass
class _SequenceHead:
    context: HeadContext = field(default_factory=HeadContext)
    pending_start: int = 0  # position of pending's first row
    pending: torch.Tensor | None = None  # [m, hidden] true features not yet fed
    sampling: DraftSampling = DraftSampling()
    generator: torch.Generator | None = None


class EagleProposer(Proposer):
    def __init__(self, drafter: HeadDrafter, top_k: int = 4, max_top_k: int = 16) -> None:
        """`top_k`: children per expanded tree node; `max_top_k`: most tokens of a sampled
        node's distribution sent (and sampled from)."""
        self.drafter = drafter
        self.top_k = top_k
        self.max_top_k = max_top_k
        self.vocab_size = drafter.parts.vocab_size
        self.hidden_size = drafter.head.config.hidden_size
        self._seqs: dict[str, _SequenceHead] = {}

    @classmethod
    def load(cls, head_path: Path, target_dir: Path, dtype: torch.dtype = torch.float32,
             device: str = "cpu", top_k: int = 4) -> EagleProposer:
        """The head at `head_path` over the target at `target_dir` (HeadMismatch when the head
        was trained for another model)."""
        parts = TargetParts.load(target_dir, dtype, device)
        head = load_head(head_path, parts.identity, dtype, device)
        log.info("feature head %s loaded for target %s", head_path, target_dir)
        return cls(HeadDrafter(head, parts), top_k)

    def observe(self, sequence_id: str, new_token_ids: Sequence[int]) -> None:
        self._seqs.setdefault(sequence_id, _SequenceHead())

    def add_features(self, sequence_id: str, start: int, features: torch.Tensor) -> None:
        """features [m, hidden]: the target's features of positions start .. start + m - 1."""
        seq = self._seqs.setdefault(sequence_id, _SequenceHead())
        if seq.pending is not None and start == seq.pending_start + len(seq.pending):
            seq.pending = torch.cat([seq.pending, features])
        else:
            seq.pending_start, seq.pending = start, features

    def set_sampling(self, sequence_id: str, sampling: DraftSampling) -> None:
        seq = self._seqs.setdefault(sequence_id, _SequenceHead())
        seq.sampling = sampling
        if not sampling.greedy and seq.generator is None:
            seq.generator = sampling.generator(self.drafter.device)

    def release(self, sequence_id: str) -> None:
        self._seqs.pop(sequence_id, None)

    def propose(self, states: Sequence[SequenceState], max_depth: int, max_nodes: int) -> list[DraftTree]:
        if max_depth < 1 or max_nodes < 1:
            raise ValueError(f"max_depth and max_nodes must be >= 1, got {max_depth}, {max_nodes}")
        return self.propose_batch(states, [max_depth] * len(states), [max_nodes] * len(states))

    def propose_batch(self, states: Sequence[SequenceState], max_depths: Sequence[int],
                      max_nodes: Sequence[int]) -> list[DraftTree]:
        """One head forward feeds every sequence's new true features; then every chain of the batch
        drafts in one head forward per depth, and every tree likewise."""
        trees: list[DraftTree | None] = [None] * len(states)
        chains: list[int] = []
        dynamic: list[int] = []
        if any(limit < 1 for limit in (*max_depths, *max_nodes)):
            raise ValueError(f"max_depth and max_nodes must be >= 1, got {list(max_depths)}, {list(max_nodes)}")
        seqs = [self._seqs.setdefault(state.sequence_id, _SequenceHead()) for state in states]
        feeds = [self._to_feed(seq, state) for seq, state in zip(seqs, states)]
        self.drafter.feed_many([seq.context for seq in seqs], [tokens for tokens, _ in feeds], [rows for _, rows in feeds])
        for i, (state, seq, depth, nodes) in enumerate(zip(states, seqs, max_depths, max_nodes, strict=True)):
            if seq.context.last is None or seq.context.end != state.num_tokens - 1:
                trees[i] = DraftTree.empty(state.sequence_id)  # no feature of the newest position
            elif nodes > depth:  # a tree (sampled requests' too: deterministic proposals, drafter.py)
                dynamic.append(i)
            else:
                chains.append(i)
        if dynamic:
            drafted = self.drafter.trees([seqs[i].context for i in dynamic], [states[i].sequence_id for i in dynamic],
                                         [max_depths[i] for i in dynamic], [max_nodes[i] for i in dynamic], self.top_k,
                                         [seqs[i].sampling.temperature or 1.0 for i in dynamic])
            for i, tree in zip(dynamic, drafted):
                trees[i] = tree
        if chains:
            drafted = self.drafter.chains([seqs[i].context for i in chains], [states[i].sequence_id for i in chains],
                                          [min(max_depths[i], max_nodes[i]) for i in chains],
                                          [seqs[i].sampling for i in chains], [seqs[i].generator for i in chains],
                                          self.max_top_k)
            for i, tree in zip(chains, drafted):
                trees[i] = tree
        return trees  # type: ignore[return-value]

    def context_span(self, sequence_id: str) -> tuple[int, int]:
        """Head positions [start, end) the sequence's context holds ((0, 0) when unknown)."""
        seq = self._seqs.get(sequence_id)
        return (0, 0) if seq is None else (seq.context.start, seq.context.end)

    # ---- helpers ------------------------------------------------------------------------

    def _to_feed(self, seq: _SequenceHead, state: SequenceState) -> tuple[list[int], torch.Tensor | None]:
        """The pending features that have their next token, and those tokens (taken from
        pending); restarts the context at a gap."""
        if seq.pending is None:
            return [], None
        start, rows = seq.pending_start, seq.pending
        ctx = seq.context
        if start > ctx.end or start < ctx.start:
            ctx.reset(start)  # a gap (or a resent history): what is before it is lost
        skip = ctx.end - start  # rows the context already holds
        usable = min(len(rows), state.num_tokens - 1 - start)  # feature j needs token j + 1
        if usable < len(rows):
            seq.pending_start, seq.pending = start + usable, rows[usable:]
        else:
            seq.pending = None
        if usable <= skip:
            return [], None
        return state.token_ids[start + skip + 1:start + usable + 1].tolist(), rows[skip:usable]
