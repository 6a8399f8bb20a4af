"""The draft tree: draft tokens of one sequence for one verify pass, in flat form.

One definition for both sides: the draft service builds trees with it, and the target
reads the trees it receives through it.
"""

from __future__ import annotations

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

    Build trees only with `DraftTree.chain`, `DraftTree.from_nodes`, `DraftTree.empty` or
    `DraftTree.from_proto` (all validated); the verifier reads `token_ids`, `parents` and
    `depths`.
    """

    sequence_id: str
    token_ids: tuple[int, ...]  # [num_nodes]
    parents: tuple[int, ...]  # [num_nodes], each in [-1, i)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"draft tree of {self.sequence_id!r}: {len(self.token_ids)} tokens "
                             f"but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"draft tree of {self.sequence_id!r}: node {i} has parent "
                                 f"{parent}; parents must be in [-1, {i})")

    @classmethod
    def chain(cls, sequence_id: str, token_ids: Sequence[int]) -> DraftTree:
        """A single path: node i is the child of node i - 1."""
        return cls(sequence_id, tuple(int(t) for t in token_ids), tuple(range(-1, len(token_ids) - 1)))

    @classmethod
    def from_nodes(cls, sequence_id: str, token_ids: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """A tree from flat node lists; parents must come before their children."""
        return cls(sequence_id, tuple(int(t) for t in token_ids), tuple(int(p) for p in parents))

    @classmethod
    def empty(cls, sequence_id: str) -> DraftTree:
        return cls(sequence_id, (), ())

    @classmethod
    def from_proto(cls, message: draft_service_pb2.DraftTree) -> DraftTree:
        return cls(message.sequence_id, tuple(message.token_ids), tuple(message.parents))

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
        return draft_service_pb2.DraftTree(sequence_id=self.sequence_id, token_ids=self.token_ids,
                                           parents=self.parents)
