"""Drafting with the feature head: per-sequence head context, chains and EAGLE-2 dynamic trees.

Head context of a sequence (`HeadContext`): the head's keys and values for head positions
[start, end), each fed with a true feature from the target (f_j with embed(t_{j+1})). Draft
rows (predicted features) are scratch: they are never kept, so a rejected draft needs no
rollback beyond not keeping it, and accepted tokens come back with their true features.
A gap in the features (lost on the wire, a draft restart) restarts the context at the first
feature after it: the head then attends fewer positions (weaker drafts), never wrong ones.

Trees (EAGLE-2, arXiv 2406.16858): expansion by cumulative draft probability, `top_k`
children per expanded node and `top_k` nodes expanded per depth (one head forward per depth
for all of them, under a tree mask), then the kept nodes reranked to the node budget. The
candidate bookkeeping is the draft model's dynamic tree's (`dynamic_tree._Candidates`,
`_frontier`, `_keep`: the greedy path is always kept, so a tree never accepts less than the
chain under greedy verification).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.draft_tree import ROOT, Distribution, DraftTree
from services.draft.eagle.head import FeatureHead
from services.draft.eagle.target_parts import TargetParts
from services.draft.proposers.base import DraftSampling
from services.draft.proposers.draft_model import sparse_distribution
from services.draft.proposers.dynamic_tree import _Candidates, _frontier, _keep


@dataclass
class HeadContext:
    """The head's cached keys and values of one sequence: head positions [start, end)."""

    start: int = 0
    end: int = 0
    k: torch.Tensor | None = None  # [heads, end - start, head_dim]
    v: torch.Tensor | None = None  # [heads, end - start, head_dim]
    last: torch.Tensor | None = None  # [hidden]: predicted feature f̂_end from the last fed row

    def reset(self, start: int) -> None:
        self.start = self.end = start
        self.k = self.v = self.last = None


class HeadDrafter:
    """The head and the target's frozen parts: feeds true features, drafts chains and trees."""

    def __init__(self, head: FeatureHead, parts: TargetParts) -> None:
        self.head = head
        self.parts = parts
        self.dtype = next(head.parameters()).dtype
        self.device = next(head.parameters()).device

    @torch.inference_mode()
    def feed(self, ctx: HeadContext, next_tokens: Sequence[int], features: torch.Tensor) -> None:
        """Feeds head positions ctx.end .. ctx.end + m - 1: features [m, hidden] (f_j) with
        next_tokens [m] (t_{j+1}); sets ctx.last to the predicted feature after the last one."""
        if not next_tokens:
            return
        m = len(next_tokens)
        ids = torch.tensor(list(next_tokens), dtype=torch.long, device=self.device)  # [m]
        positions = torch.arange(ctx.end, ctx.end + m, device=self.device)  # [m]
        out, k, v = self.head(self.parts.embed(ids).to(self.dtype), features.to(self.device, self.dtype),
                              positions, ctx.k, ctx.v)  # out [m, hidden]
        ctx.k = k if ctx.k is None else torch.cat([ctx.k, k], dim=1)
        ctx.v = v if ctx.v is None else torch.cat([ctx.v, v], dim=1)
        ctx.end += m
        ctx.last = self.parts.final_norm(out[-1])

    @torch.inference_mode()
    def chain(self, ctx: HeadContext, sequence_id: str, num_tokens: int, sampling: DraftSampling,
              generator: torch.Generator | None, max_top_k: int) -> DraftTree:
        """A chain of `num_tokens` drafts after the context: the head's argmax chain, or for a
        sampled request tokens drawn from the sparse distributions sent with them."""
        feature = ctx.last  # [hidden]
        k, v = ctx.k, ctx.v
        tokens: list[int] = []
        distributions: list[Distribution] = []
        for i in range(num_tokens):
            logits = self.parts.features_to_logits(feature)  # [vocab]
            if sampling.greedy:
                tokens.append(int(torch.argmax(logits)))
            else:
                ids, probs = sparse_distribution(logits, sampling, max_top_k)  # [k], [k]
                tokens.append(int(ids[int(torch.multinomial(probs, 1, generator=generator))]))
                distributions.append(Distribution(tuple(ids.tolist()), tuple(probs.tolist())))
            if i + 1 < num_tokens:
                ids = torch.tensor(tokens[-1:], device=self.device)
                pos = torch.tensor([ctx.end + i], device=self.device)
                out, nk, nv = self.head(self.parts.embed(ids).to(self.dtype), feature[None], pos, k, v)
                k, v = torch.cat([k, nk], dim=1), torch.cat([v, nv], dim=1)
                feature = self.parts.final_norm(out[0])
        return DraftTree.chain(sequence_id, tokens, distributions)

    @torch.inference_mode()
    def tree(self, ctx: HeadContext, sequence_id: str, max_depth: int, max_nodes: int,
             top_k: int) -> DraftTree:
        """An EAGLE-2 dynamic tree (greedy requests): see the module docstring."""
        width = 1 if max_nodes <= max_depth else top_k
        c = _Candidates()
        c.add_children(ROOT, 0, 1.0, torch.softmax(self.parts.features_to_logits(ctx.last), -1), width)
        source = [ctx.last] * len(c.tokens)  # per candidate: the predicted feature its token came from
        greedy, level = [0], list(range(len(c.tokens)))
        fed: list[int] = []  # candidate of each scratch row, in order
        k, v = ctx.k, ctx.v
        for depth in range(1, max_depth):
            frontier = _frontier(c, level, greedy[-1], top_k)
            ids = torch.tensor([c.tokens[i] for i in frontier], device=self.device)  # [f]
            feats = torch.stack([source[i] for i in frontier])  # [f, hidden]
            pos = torch.full((len(frontier),), ctx.end - 1 + depth, device=self.device)  # [f]
            mask = self._tree_mask(c, fed, frontier, ctx.end - ctx.start)  # [f, s + fed + f]
            out, nk, nv = self.head(self.parts.embed(ids).to(self.dtype), feats, pos, k, v, mask)
            k, v = torch.cat([k, nk], dim=1), torch.cat([v, nv], dim=1)
            fed += frontier
            predicted = self.parts.final_norm(out)  # [f, hidden]
            probs = torch.softmax(self.parts.features_to_logits(predicted), -1)  # [f, vocab]
            level = []
            for row, node in enumerate(frontier):
                c.expanded[node] = True
                first = len(c.tokens)
                c.add_children(node, depth, c.cum[node], probs[row], width)
                source += [predicted[row]] * (len(c.tokens) - first)
                if node == greedy[-1]:
                    greedy.append(first)
                level += range(first, len(c.tokens))
        kept = _keep(c, greedy[:min(max_depth, max_nodes)], max_nodes)
        index = {node: i for i, node in enumerate(kept)}
        return DraftTree.from_nodes(sequence_id, [c.tokens[i] for i in kept],
                                    [ROOT if c.parents[i] == ROOT else index[c.parents[i]] for i in kept])

    def _tree_mask(self, c: _Candidates, fed: list[int], frontier: list[int], cached: int) -> torch.Tensor:
        """[len(frontier), cached + len(fed) + len(frontier)] bool: each frontier node sees the
        cached context, its fed ancestors and itself."""
        slots = fed + frontier
        slot_of = {node: i for i, node in enumerate(slots)}
        allowed = torch.zeros(len(frontier), cached + len(slots), dtype=torch.bool, device=self.device)
        allowed[:, :cached] = True
        for row, node in enumerate(frontier):
            walk = node
            while walk != ROOT:
                allowed[row, cached + slot_of[walk]] = True
                walk = c.parents[walk]
        return allowed
