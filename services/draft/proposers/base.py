"""The proposer interface and the draft tree it returns.

A *proposer* turns the committed tokens of a sequence into *draft tokens* for one
verify pass (docs/speculation.md). Every method (prompt lookup, suffix tree, draft model,
dynamic tree) implements `Proposer`; the draft service only talks to this interface.

Who owns what:
- `DraftStateStore` (services/draft/state.py) owns the committed token history of
  every sequence; proposers read it through `SequenceState` and never change it.
- A proposer owns only its derived per-sequence state (an n-gram index, a suffix
  tree, a draft model's KV). The service calls `observe` with every batch of newly
  committed tokens and `release` when a sequence ends.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.draft_tree import ROOT, DraftTree  # noqa: F401  (re-exported for proposers)
from services.draft.state import SequenceState


@dataclass(frozen=True)
class DraftSampling:
    """The request's sampling, as the target samples (temperature 0 = greedy; top_k / top_p
    0 = off); `seed` seeds a sampling proposer's own generator (None = random)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def generator(self, device) -> "torch.Generator":
        """A sampling proposer's own generator for this request: seeded by `seed`, else random."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


class Proposer(abc.ABC):
    """One speculation method. Implementations are not thread-safe; the service calls
    them from one event loop.

    The service calls `propose_batch` once per request and method with per-sequence
    limits; its default groups the sequences by (max_depth, max_nodes) and calls
    `propose` per group. Proposers that batch across limits override it.
    """

    # Token ids a proposer accepts are in [0, vocab_size); None = any id >= 0. The service
    # answers INVALID_ARGUMENT for ids outside (a draft model cannot embed them).
    vocab_size: int | None = None

    @abc.abstractmethod
    def propose(self, states: Sequence[SequenceState], max_depth: int, max_nodes: int) -> list[DraftTree]:
        """One draft tree per state, in the same order.

        `max_depth` (>= 1) bounds the depth of every node; `max_nodes` (>= 1) bounds the
        number of nodes of each tree. Returns an empty tree when there is nothing to propose.
        """

    def propose_batch(self, states: Sequence[SequenceState], max_depths: Sequence[int],
                      max_nodes: Sequence[int]) -> list[DraftTree]:
        """One draft tree per state, in the same order; `max_depths[i]` and `max_nodes[i]`
        bound the tree of `states[i]` as in `propose`."""
        if not len(states) == len(max_depths) == len(max_nodes):
            raise ValueError(f"{len(states)} states but {len(max_depths)} max_depths and "
                             f"{len(max_nodes)} max_nodes")
        groups: dict[tuple[int, int], list[int]] = {}
        for i, limits in enumerate(zip(max_depths, max_nodes)):
            groups.setdefault(limits, []).append(i)
        trees: list[DraftTree | None] = [None] * len(states)
        for (max_depth, nodes), indices in groups.items():
            for i, tree in zip(indices, self.propose([states[i] for i in indices], max_depth, nodes)):
                trees[i] = tree
        return trees  # type: ignore[return-value]

    @abc.abstractmethod
    def observe(self, sequence_id: str, new_token_ids: Sequence[int]) -> None:
        """`new_token_ids` were committed (appended to the sequence's history).

        Called once per append, after the store has appended them and before `propose`.
        The first call for a sequence carries its whole prompt.
        """

    def set_sampling(self, sequence_id: str, sampling: DraftSampling) -> None:
        """The sequence's sampling, set before every `propose` that includes it. Deterministic
        proposers ignore it (their one-hot q is their true q); a proposer with a distribution
        samples its drafts from it and sends it (DraftTree.distributions)."""

    @abc.abstractmethod
    def release(self, sequence_id: str) -> None:
        """Drops all state of the sequence; unknown ids are ignored."""
