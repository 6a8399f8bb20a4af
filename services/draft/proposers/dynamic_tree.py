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
Ties between tokens are broken by token id (stable sort). The cache is cropped back
to the committed tokens afterwards; tree KV is scratch.

The greedy-path reservation differs from EAGLE-2's pure top-probability rerank: it
makes the tree a superset of the DRAFT_MODEL chain (so greedy acceptance is never
shorter than the chain's), at the price that greedy-path nodes may have a lower
cumulative probability than some dropped candidate.

Draft probabilities are not returned (the proto has no field for them); the target
treats proposals as deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.draft.proposers.base import ROOT, DraftTree
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
        if max_depth < 1 or max_nodes < 1:
            raise ValueError(f"max_depth and max_nodes must be >= 1, got {max_depth}, {max_nodes}")
        return [self.build(state, max_depth, max_nodes).tree for state in states]

    def build(self, state: SequenceState, max_depth: int, max_nodes: int) -> TreeBuild:
        kv, logits = self._sync(state)
        num_committed = len(kv.token_ids)
        # A pure chain needs no side branches: expand the greedy path only.
        width = 1 if max_nodes <= max_depth else self.top_k
        c = _Candidates()
        c.add_children(ROOT, 0, 1.0, torch.softmax(logits, dim=-1), width)
        greedy = [0]
        level = list(range(len(c.tokens)))
        fed: list[int] = []  # candidate index of each tree slot in the cache, in order
        try:
            for depth in range(1, max_depth):
                frontier = _frontier(c, level, greedy[-1], self.top_k)
                mask = self._tree_mask(c, fed, frontier, num_committed)
                positions = [num_committed - 1 + depth] * len(frontier)
                out = self.draft.forward_masked(kv.cache, [c.tokens[i] for i in frontier], positions, mask)
                fed += frontier
                probs = torch.softmax(out, dim=-1)  # [len(frontier), vocab]
                level = []
                for row, node in enumerate(frontier):
                    c.expanded[node] = True
                    first = len(c.tokens)
                    c.add_children(node, depth, c.cum[node], probs[row], width)
                    if node == greedy[-1]:
                        greedy.append(first)
                    level += range(first, len(c.tokens))
        finally:  # tree KV is scratch: back to the committed tokens
            kv.cache.crop(num_committed - kv.cache.get_seq_length())
        kept = _keep(c, greedy[:min(max_depth, max_nodes)], max_nodes)
        position = {node: i for i, node in enumerate(kept)}
        tree = DraftTree.from_nodes(state.sequence_id, [c.tokens[i] for i in kept],
                                    [ROOT if c.parents[i] == ROOT else position[c.parents[i]] for i in kept])
        return TreeBuild(tree, tuple(c.tokens), tuple(c.parents), tuple(c.depths), tuple(c.cum),
                         tuple(c.expanded), tuple(kept), tuple(greedy))

    # ---- helpers ------------------------------------------------------------------------

    def _tree_mask(self, c: _Candidates, fed: list[int], frontier: list[int],
                   num_committed: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive mask [1, 1, len(frontier), num_committed + len(fed) + len(frontier)]:
        each frontier node sees the committed prefix, its fed ancestors and itself (and
        only keys within the sliding window on sliding-window layers)."""
        slots = fed + frontier
        allowed = _sees(c, fed, frontier, num_committed, torch.device("cpu"))
        key_pos = torch.cat([torch.arange(num_committed),
                             torch.tensor([num_committed - 1 + c.depths[n] for n in slots], dtype=torch.long)])
        query_pos = torch.tensor([num_committed - 1 + c.depths[n] for n in frontier], dtype=torch.long)
        windows = _layer_windows(self.draft.config)
        masks = {kind: _additive(allowed if window is None else
                                 allowed & (key_pos[None, :] > query_pos[:, None] - window),
                                 self.draft.dtype, self.draft.device)
                 for kind, window in windows.items()}
        return masks if len(masks) > 1 else next(iter(masks.values()))


class _Candidates:
    """Flat candidate nodes in creation order."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.cum: list[float] = []
        self.expanded: list[bool] = []

    def add_children(self, parent: int, parent_depth: int, parent_cum: float, probs: torch.Tensor,
                     width: int) -> None:
        """The `width` most likely tokens of `probs` ([vocab]); ties go to the lower id."""
        values, ids = torch.sort(probs.double(), descending=True, stable=True)
        for p, token in zip(values[:width].tolist(), ids[:width].tolist()):
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


def _layer_windows(config) -> dict[str, int | None]:
    """Sliding window per attention layer type; one entry ("all") when all layers agree."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types and "sliding_attention" in layer_types and window:
        windows: dict[str, int | None] = {"full_attention": None, "sliding_attention": int(window)}
        return {kind: windows[kind] for kind in dict.fromkeys(layer_types)}
    if not layer_types and window and getattr(config, "use_sliding_window", True):
        return {"all": int(window)}  # e.g. Mistral: every layer slides
    return {"all": None}


def _additive(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[q, k] bool -> [1, 1, q, k] additive mask (0 where allowed, dtype min elsewhere)."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


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
