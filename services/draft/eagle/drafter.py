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
from services.draft.proposers.dynamic_tree import _Candidates, _frontier, _keep, _sees


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

    def chain(self, ctx: HeadContext, sequence_id: str, num_tokens: int, sampling: DraftSampling,
              generator: torch.Generator | None, max_top_k: int) -> DraftTree:
        """A chain of `num_tokens` drafts after the context: the head's argmax chain, or for a
        sampled request tokens drawn from the sparse distributions sent with them."""
        return self.chains([ctx], [sequence_id], [num_tokens], [sampling], [generator], max_top_k)[0]

    @torch.inference_mode()
    def chains(self, ctxs: Sequence[HeadContext], sequence_ids: Sequence[str], num_tokens: Sequence[int],
               samplings: Sequence[DraftSampling], generators: Sequence[torch.Generator | None],
               max_top_k: int) -> list[DraftTree]:
        """`chain` for several sequences at once: one head forward per depth for all of them, their
        cached keys padded to the longest context (padding masked out)."""
        b, depth = len(ctxs), max(num_tokens)
        width = max(c.end - c.start for c in ctxs)
        k = ctxs[0].k.new_zeros(b, *ctxs[0].k.shape[:1], width, ctxs[0].k.shape[2])  # [b, heads, width, head_dim]
        v = torch.zeros_like(k)
        visible = torch.zeros(b, width, dtype=torch.bool, device=self.device)  # [b, keys]
        for i, c in enumerate(ctxs):
            k[i, :, :c.k.shape[1]], v[i, :, :c.v.shape[1]] = c.k, c.v
            visible[i, :c.k.shape[1]] = True
        feature = torch.stack([c.last for c in ctxs])  # [b, hidden]
        ends = torch.tensor([c.end for c in ctxs], device=self.device)  # [b]
        tokens: list[list[int]] = [[] for _ in ctxs]
        distributions: list[list[Distribution]] = [[] for _ in ctxs]
        for step in range(depth):
            logits = self.parts.features_to_logits(feature)  # [b, vocab]
            for i in range(b):
                if step < num_tokens[i]:
                    self._pick(logits[i], samplings[i], generators[i], max_top_k, tokens[i], distributions[i])
            if step + 1 < depth:
                ids = torch.tensor([t[-1] for t in tokens], device=self.device)[:, None]  # [b, 1]
                visible = torch.cat([visible, visible.new_ones(b, 1)], dim=1)  # the new row sees itself
                out, nk, nv = self.head(self.parts.embed(ids).to(self.dtype), feature[:, None],
                                        (ends + step)[:, None], k, v, visible[:, None, None])  # out [b, 1, hidden]
                k, v = torch.cat([k, nk], dim=-2), torch.cat([v, nv], dim=-2)
                feature = self.parts.final_norm(out[:, 0])
        return [DraftTree.chain(sid, t, d) for sid, t, d in zip(sequence_ids, tokens, distributions)]

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: DraftSampling, generator: torch.Generator | None, max_top_k: int,
              tokens: list[int], distributions: list[Distribution]) -> None:
        """Appends the next draft token of logits [vocab]: argmax, or drawn from the sparse q sent with it."""
        if sampling.greedy:
            tokens.append(int(torch.argmax(logits)))  # first maximum: ties go to the lowest id
            return
        ids, probs = sparse_distribution(logits, sampling, max_top_k)  # [k], [k]
        tokens.append(int(ids[int(torch.multinomial(probs, 1, generator=generator))]))
        distributions.append(Distribution(tuple(ids.tolist()), tuple(probs.tolist())))

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
        return _sees(c, fed, frontier, cached, self.device)
