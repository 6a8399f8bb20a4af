"""Dynamic draft trees (EAGLE-2 style) from the draft model.

Words: a node's *cumulative probability* is the product of the draft model's
probabilities along its path from the last committed token.

Per proposal (`build`):
1. expand: the root's `top_k` most likely tokens are the depth-1 candidates. At each
   depth d < max_depth the `top_k` candidates of depth d with the highest cumulative
   probability are expanded (one draft forward pass for all of them, with a tree
   attention mask over the sequence's cached committed prefix): each gets its `top_k`
   most likely tokens as depth d + 1 candidates. One slot is reserved for the greedy
   path (the top-1 child of the top-1 child of ...), so the draft model's greedy chain
   is always a root path of the candidates.
2. keep: the greedy path (min(max_depth, max_nodes) nodes), then the other candidates
   by cumulative probability (ties: shallower first, then earlier created), up to
   `max_nodes` nodes. A child's cumulative probability never exceeds its parent's, so
   the kept tree is closed under parents; nodes are output in keep order, so parents
   come before children.
Ties between tokens are broken by token id (stable sort). All sequences of one
`propose_batch` expand together: one draft forward per depth for every frontier
(`BatchedForward`); tree rows are scratch, never written back to a sequence's cache.

The greedy-path reservation differs from EAGLE-2's pure top-probability rerank: it
makes the tree a superset of the DRAFT_MODEL chain (so greedy acceptance is never
shorter than the chain's), at the price that greedy-path nodes may have a lower
cumulative probability than some dropped candidate.

Trees go without draft distributions (siblings are distinct top-k tokens, not independent
draws from one q): the target treats their nodes as one-hot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.draft.proposers.base import ROOT, DraftTree
from services.draft.proposers.batched_forward import BatchedForward
from services.draft.proposers.draft_model import DraftModel, DraftModelProposer
from services.draft.state import SequenceState


@dataclass(frozen=True)
class TreeBuild:
    """A dynamic tree and every candidate it was chosen from (for tests and metrics)."""

    tree: DraftTree
    # Candidates, in creation order; `candidate_parents` index candidates (-1 = root).
    candidate_token_ids: tuple[int, ...]  # [num_candidates]
    candidate_parents: tuple[int, ...]  # [num_candidates]
    candidate_depths: tuple[int, ...]  # [num_candidates]
    cumulative_probs: tuple[float, ...]  # [num_candidates]
    expanded: tuple[bool, ...]  # [num_candidates]: fed to the draft model for children
    kept: tuple[int, ...]  # [num_nodes]: candidate index of each tree node
    greedy_path: tuple[int, ...]  # candidate indices of the greedy path, by depth


class DynamicTreeProposer(DraftModelProposer):
    def __init__(self, draft: DraftModel, top_k: int = 4) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        super().__init__(draft)
        self.top_k = top_k

    def set_sampling(self, sequence_id: str, sampling) -> None:
        """Ignored: the tree's siblings are distinct top-k tokens (drawn without replacement, not
        independent draws from one q), so its trees go without distributions (one-hot q)."""

    def propose(self, states: Sequence[SequenceState], max_depth: int, max_nodes: int) -> list[DraftTree]:
        return self.propose_batch(states, [max_depth] * len(states), [max_nodes] * len(states))

    def propose_batch(self, states: Sequence[SequenceState], max_depths: Sequence[int],
                      max_nodes: Sequence[int]) -> list[DraftTree]:
        return [build.tree for build in self.build_batch(states, max_depths, max_nodes)]

    def build(self, state: SequenceState, max_depth: int, max_nodes: int) -> TreeBuild:
        return self.build_batch([state], [max_depth], [max_nodes])[0]

    def build_batch(self, states: Sequence[SequenceState], max_depths: Sequence[int],
                    max_nodes: Sequence[int]) -> list[TreeBuild]:
        """The trees of all states, one draft forward per depth for all of them (BatchedForward)."""
        if not len(states) == len(max_depths) == len(max_nodes):
            raise ValueError(f"{len(states)} states but {len(max_depths)} max_depths and {len(max_nodes)} max_nodes")
        if any(limit < 1 for limit in (*max_depths, *max_nodes)):
            raise ValueError(f"max_depth and max_nodes must be >= 1, got {list(max_depths)}, {list(max_nodes)}")
        if not states:
            return []
        kvs, feeds = zip(*(self._prepare(state) for state in states))
        batch = BatchedForward(self.draft, [kv.cache for kv in kvs])
        committed = [len(kv.token_ids) + len(feed) for kv, feed in zip(kvs, feeds)]  # tokens after the feed
        first = batch.feed(feeds, [range(n - len(feed), n) for n, feed in zip(committed, feeds)],
                           [None] * len(kvs), [[len(feed) - 1] for feed in feeds])
        for i, kv in enumerate(kvs):  # the committed tokens stay in the cache; the tree's rows are scratch
            batch.write_back(i, kv.cache, range(len(feeds[i])))
            kv.token_ids.extend(feeds[i])
        # A pure chain needs no side branches: expand the greedy path only.
        widths = [1 if nodes <= depth else self.top_k for depth, nodes in zip(max_depths, max_nodes)]
        cands = [_Candidates() for _ in states]
        for c, logits, width in zip(cands, first, widths):
            c.add_children(ROOT, 0, 1.0, torch.softmax(logits[0], dim=-1), width)
        greedy = [[0] for _ in states]
        levels = [list(range(len(c.tokens))) for c in cands]
        fed: list[list[int]] = [[] for _ in states]  # per row: candidate of each tree row fed, in order
        for depth in range(1, max(max_depths)):
            growing = [depth < max_depth for max_depth in max_depths]
            frontiers = [_frontier(c, level, path[-1], self.top_k) if grow else []
                         for c, level, path, grow in zip(cands, levels, greedy, growing)]
            out = batch.feed([[c.tokens[n] for n in f] for c, f in zip(cands, frontiers)],
                             [[n - 1 + depth] * len(f) for n, f in zip(committed, frontiers)],
                             [_sees(c, rows, f, len(feed), torch.device("cpu"))
                              for c, rows, f, feed in zip(cands, fed, frontiers, feeds)],
                             [range(len(f)) for f in frontiers])
            for i, frontier in enumerate(frontiers):
                if not frontier:
                    continue
                c, probs = cands[i], torch.softmax(out[i], dim=-1)  # [len(frontier), vocab]
                fed[i] += frontier
                levels[i] = []
                for row, node in enumerate(frontier):
                    c.expanded[node] = True
                    start = len(c.tokens)
                    c.add_children(node, depth, c.cum[node], probs[row], widths[i])
                    if node == greedy[i][-1]:
                        greedy[i].append(start)
                    levels[i] += range(start, len(c.tokens))
        return [_built(state.sequence_id, c, path, max_depth, nodes)
                for state, c, path, max_depth, nodes in zip(states, cands, greedy, max_depths, max_nodes)]


def _built(sequence_id: str, c: _Candidates, greedy: list[int], max_depth: int, max_nodes: int) -> TreeBuild:
    kept = _keep(c, greedy[:min(max_depth, max_nodes)], max_nodes)
    position = {node: i for i, node in enumerate(kept)}
    tree = DraftTree.from_nodes(sequence_id, [c.tokens[i] for i in kept],
                                [ROOT if c.parents[i] == ROOT else position[c.parents[i]] for i in kept])
    return TreeBuild(tree, tuple(c.tokens), tuple(c.parents), tuple(c.depths), tuple(c.cum),
                     tuple(c.expanded), tuple(kept), tuple(greedy))


class _Candidates:
    """Flat candidate nodes in creation order."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.cum: list[float] = []
        self.expanded: list[bool] = []

    def add_children(self, parent: int, parent_depth: int, parent_cum: float, probs: torch.Tensor,
                     width: int, vocab: torch.Tensor | None = None) -> None:
        """The `width` most likely tokens of `probs` ([vocab], or [V'] over the token ids `vocab`,
        ascending); ties go to the lower id."""
        values, ids = torch.sort(probs.double(), descending=True, stable=True)
        ids = ids[:width] if vocab is None else vocab[ids[:width].to(vocab.device)]
        for p, token in zip(values[:width].tolist(), ids.tolist()):
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(parent_depth + 1)
            self.cum.append(parent_cum * p)
            self.expanded.append(False)


def _frontier(c: _Candidates, level: list[int], greedy: int, top_k: int) -> list[int]:
    """The greedy node and the best `top_k` - 1 other nodes of `level`, best first."""
    others = sorted((i for i in level if i != greedy), key=lambda i: (-c.cum[i], i))
    return sorted([greedy] + others[:top_k - 1], key=lambda i: (-c.cum[i], i))


def _keep(c: _Candidates, chain: list[int], max_nodes: int) -> list[int]:
    chosen = set(chain)
    rest = sorted((i for i in range(len(c.tokens)) if i not in chosen),
                  key=lambda i: (-c.cum[i], c.depths[i], i))
    return chain + rest[:max(0, max_nodes - len(chain))]


def _sees(c: _Candidates, fed: list[int], frontier: list[int], cached: int, device) -> torch.Tensor:
    """[len(frontier), cached + len(fed) + len(frontier)] bool: each frontier node sees the
    cached context, its fed ancestors and itself (keys: the context, then fed, then frontier)."""
    slot_of = {node: i for i, node in enumerate(fed + frontier)}
    allowed = torch.zeros(len(frontier), cached + len(slot_of), dtype=torch.bool, device=device)
    allowed[:, :cached] = True
    for row, node in enumerate(frontier):
        walk = node
        while walk != ROOT:
            allowed[row, cached + slot_of[walk]] = True
            walk = c.parents[walk]
    return allowed
