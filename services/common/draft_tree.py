"""The draft tree: draft tokens of one sequence for one verify pass, in flat form.

One definition for both sides: the draft service builds trees with it, and the target
reads the trees it receives through it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.proto.v1 import draft_service_pb2

ROOT = -1  # parent index of a node that follows the last committed token


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens of one sequence for one verify pass, in flat form.

    Node i has token `token_ids[i]` and parent `parents[i]`; `ROOT` (-1) means the
    node follows the last committed token. Parents come before their children
    (`parents[i] < i`), so `depths` can be computed in one pass; a node's depth is
    its position offset after the last committed token (root children have depth 1).
    A chain has parents [-1, 0, 1, ...]. An empty tree means "no draft this step".

    `distributions`: empty (deterministic proposals, q = one-hot of each token), or per node
    the sparse draft distribution (token ids, probabilities) its token was sampled from; its
    shape is checked here, its values by the target (`distribution_problem`) before use.

    Build trees only with `DraftTree.chain`, `DraftTree.from_nodes`, `DraftTree.empty` or
    `DraftTree.from_proto` (all validated); the verifier reads `token_ids`, `parents` and
    `depths`.
    """

    sequence_id: str
    token_ids: tuple[int, ...]  # [num_nodes]
    parents: tuple[int, ...]  # [num_nodes], each in [-1, i)
    distributions: tuple[Distribution, ...] = ()  # [] or [num_nodes]

    def __post_init__(self) -> None:
        if self.distributions and len(self.distributions) != len(self.token_ids):
            raise ValueError(f"draft tree of {self.sequence_id!r}: {len(self.distributions)} "
                             f"distributions for {len(self.token_ids)} nodes")
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"draft tree of {self.sequence_id!r}: {len(self.token_ids)} tokens "
                             f"but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"draft tree of {self.sequence_id!r}: node {i} has parent "
                                 f"{parent}; parents must be in [-1, {i})")

    @classmethod
    def chain(cls, sequence_id: str, token_ids: Sequence[int],
              distributions: Sequence[Distribution] = ()) -> DraftTree:
        """A single path: node i is the child of node i - 1."""
        return cls(sequence_id, tuple(int(t) for t in token_ids), tuple(range(-1, len(token_ids) - 1)),
                   tuple(distributions))

    @classmethod
    def from_nodes(cls, sequence_id: str, token_ids: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """A tree from flat node lists; parents must come before their children."""
        return cls(sequence_id, tuple(int(t) for t in token_ids), tuple(int(p) for p in parents))

    @classmethod
    def empty(cls, sequence_id: str) -> DraftTree:
        return cls(sequence_id, (), ())

    @classmethod
    def from_proto(cls, message: draft_service_pb2.DraftTree) -> DraftTree:
        distributions = tuple(Distribution(tuple(d.token_ids), tuple(d.probs)) for d in message.distributions)
        return cls(message.sequence_id, tuple(message.token_ids), tuple(message.parents), distributions)

    def keep(self, nodes: Sequence[int]) -> DraftTree:
        """The tree of `nodes` only (ascending, each with its parent kept), renumbered in order."""
        index = {old: new for new, old in enumerate(nodes)}
        parents = tuple(ROOT if self.parents[i] == ROOT else index[self.parents[i]] for i in nodes)
        distributions = tuple(self.distributions[i] for i in nodes) if self.distributions else ()
        return DraftTree(self.sequence_id, tuple(self.token_ids[i] for i in nodes), parents, distributions)

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def depths(self) -> tuple[int, ...]:  # [num_nodes], root children have depth 1
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        return tuple(depths)

    def to_proto(self) -> draft_service_pb2.DraftTree:
        return draft_service_pb2.DraftTree(
            sequence_id=self.sequence_id, token_ids=self.token_ids, parents=self.parents,
            distributions=[draft_service_pb2.DraftDistribution(token_ids=d.token_ids, probs=d.probs)
                           for d in self.distributions])

    def distribution_problem(self, vocab_size: int) -> str | None:
        """Why `distributions` cannot be the q of rejection sampling, or None when it can.

        Lossless only if each token was drawn from exactly its distribution: every one must be
        finite, non-negative, sum to 1 (within float32 rounding), hold its node's token, name
        distinct in-vocabulary ids, and no node may have a sibling (siblings are not known to
        be independent draws from one q)."""
        parents = set()
        for i, (token, parent, dist) in enumerate(zip(self.token_ids, self.parents, self.distributions)):
            if parent in parents:
                return f"node {i} has a sibling"
            parents.add(parent)
            if len(dist.token_ids) != len(dist.probs) or not dist.token_ids:
                return f"node {i}: {len(dist.token_ids)} token ids but {len(dist.probs)} probabilities"
            if len(set(dist.token_ids)) != len(dist.token_ids):
                return f"node {i}: repeated token ids"
            if any(not 0 <= t < vocab_size for t in dist.token_ids):
                return f"node {i}: token id outside the vocabulary of {vocab_size}"
            if any(not (p >= 0.0 and math.isfinite(p)) for p in dist.probs):
                return f"node {i}: a probability is negative or not finite"
            if abs(math.fsum(dist.probs) - 1.0) > 1e-3:
                return f"node {i}: probabilities sum to {math.fsum(dist.probs):.6f}, not 1"
            if dict(zip(dist.token_ids, dist.probs)).get(token, 0.0) <= 0.0:
                return f"node {i}: its token {token} has no probability"
        return None


@dataclass(frozen=True)
class Distribution:
    """A sparse draft distribution: probs[j] of token_ids[j]; every other token has 0."""

    token_ids: tuple[int, ...]  # [k]
    probs: tuple[float, ...]  # [k], summing to 1
