"""Drafting with the feature head: per-sequence head context, chains and EAGLE-2 dynamic trees.

Head context of a sequence (`HeadContext`): the head's keys and values for head positions
[start, end), each fed with a true feature from the target (f_j with embed(t_{j+1})). Draft
rows (predicted features) are scratch: they are never kept, so a rejected draft needs no
rollback beyond not keeping it, and accepted tokens come back with their true features.
A gap in the features (lost on the wire, a draft restart) restarts the context at the first
feature after it: the head then attends fewer positions (weaker drafts), never wrong ones.

Trees (EAGLE-2, arXiv 2406.16858): expansion by cumulative draft probability, `top_k`
children per expanded node and `top_k` nodes expanded per depth (one head forward per depth
for all of them and for every sequence of the batch, under a tree mask), then the kept nodes
reranked to the node budget. The candidate bookkeeping is the draft model's dynamic tree's
(`dynamic_tree._Candidates`, `_frontier`, `_keep`: the greedy path is always kept, so a tree
never accepts less than the chain under greedy verification).

Sampled requests get the same trees, their confidence taken at the request's temperature (its
top-k / top-p left out: a token they exclude is only rejected), and no draft distributions:
siblings are the head's distinct most likely tokens, not draws from one q, so the target verifies
each node as a deterministic proposal (accepted with the target's own probability of it, then
the residual without it; lossless whatever the tokens). A node's chance to be accepted is then
the product of the target's probabilities along its path, which the head's cumulative
confidence estimates. A chain (the default plan) keeps real q: its node accepts sum min(p, q),
more than p of the head's top token, while a tree's siblings add the target's probability of
each (on the default model's held-out answers sampled at T=0.8, the first draft token is
accepted 0.38 with real q, 0.33 / 0.43 / 0.51 with the head's top 1 / 2 / 4 as deterministic
proposals: benchmarks/eagle_acceptance.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.draft_tree import ROOT, Distribution, DraftTree
from services.draft.eagle.draft_vocab import DraftOutput
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
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            head.use_fast_linears()
        self.output = DraftOutput(parts, head.draft_vocab, self.dtype, fast=True)  # [.., hidden] -> [.., V']

    def feed(self, ctx: HeadContext, next_tokens: Sequence[int], features: torch.Tensor) -> None:
        """Feeds head positions ctx.end .. ctx.end + m - 1: features [m, hidden] (f_j) with
        next_tokens [m] (t_{j+1}); sets ctx.last to the predicted feature after the last one."""
        self.feed_many([ctx], [next_tokens], [features])

    @torch.inference_mode()
    def feed_many(self, ctxs: Sequence[HeadContext], next_tokens: Sequence[Sequence[int]],
                  features: Sequence[torch.Tensor | None]) -> None:
        """`feed` for several contexts in one head forward (their keys padded to the longest
        context, their new rows to the longest feed; padding masked). Empty feeds are skipped."""
        rows = [i for i, tokens in enumerate(next_tokens) if len(tokens)]
        if not rows:
            return
        ctxs = [ctxs[i] for i in rows]
        counts = [len(next_tokens[i]) for i in rows]
        b, m = len(rows), max(counts)
        k, v, real = self._padded(ctxs)  # [b, heads, width, head_dim] x2, [b, width]
        width = k.shape[2]
        ids = torch.zeros(b, m, dtype=torch.long, device=self.device)  # [b, m]
        feats = torch.zeros(b, m, self.head.config.hidden_size, dtype=self.dtype, device=self.device)  # [b, m, hidden]
        for row, (i, n) in enumerate(zip(rows, counts)):
            ids[row, :n] = torch.tensor(list(next_tokens[i]), dtype=torch.long)
            feats[row, :n] = features[i].to(self.device, self.dtype)
        positions = torch.tensor([c.end for c in ctxs], device=self.device)[:, None] + torch.arange(m, device=self.device)
        mask = torch.cat([real[:, None, :].expand(b, m, width),  # each row's own context, then causal new rows
                          torch.ones(m, m, dtype=torch.bool, device=self.device).tril().expand(b, m, m)], dim=2)
        out, nk, nv = self.head(self.parts.embed(ids).to(self.dtype), feats, positions, k, v,
                                mask[:, None])  # out [b, m, hidden]; nk, nv [b, heads, m, head_dim]
        for row, (ctx, n) in enumerate(zip(ctxs, counts)):
            ctx.k = nk[row, :, :n] if ctx.k is None else torch.cat([ctx.k, nk[row, :, :n]], dim=1)
            ctx.v = nv[row, :, :n] if ctx.v is None else torch.cat([ctx.v, nv[row, :, :n]], dim=1)
            ctx.end += n
            ctx.last = self.parts.final_norm(out[row, n - 1])

    def _padded(self, ctxs: Sequence[HeadContext]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The contexts' cached keys and values padded to the longest: k, v [b, heads, width,
        head_dim], and [b, width] bool: which columns are the row's own."""
        c = self.head.config
        width = max(ctx.end - ctx.start for ctx in ctxs)
        k = torch.zeros(len(ctxs), c.num_heads, width, c.head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        real = torch.zeros(len(ctxs), width, dtype=torch.bool, device=self.device)
        for i, ctx in enumerate(ctxs):
            n = ctx.end - ctx.start
            if n:
                k[i, :, :n], v[i, :, :n] = ctx.k, ctx.v
                real[i, :n] = True
        return k, v, real

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
        k, v, visible = self._padded(ctxs)  # [b, heads, width, head_dim] x2, [b, keys]
        feature = torch.stack([c.last for c in ctxs])  # [b, hidden]
        ends = torch.tensor([c.end for c in ctxs], device=self.device)  # [b]
        tokens: list[list[int]] = [[] for _ in ctxs]
        distributions: list[list[Distribution]] = [[] for _ in ctxs]
        for step in range(depth):
            logits = self.output(feature)  # [b, V']
            for i in range(b):
                if step < num_tokens[i]:
                    self._pick(logits[i], samplings[i], generators[i], max_top_k, tokens[i], distributions[i])
            if step + 1 < depth:
                ids = torch.tensor([t[-1] for t in tokens], device=self.device)[:, None]  # [b, 1]
                visible = torch.cat([visible, visible.new_ones(b, 1)], dim=1)  # the new row sees itself
                mask = None if b == 1 else visible[:, None, None]  # one sequence sees every key it has
                out, nk, nv = self.head(self.parts.embed(ids).to(self.dtype), feature[:, None],
                                        (ends + step)[:, None], k, v, mask)  # out [b, 1, hidden]
                k, v = torch.cat([k, nk], dim=-2), torch.cat([v, nv], dim=-2)
                feature = self.parts.final_norm(out[:, 0])
        return [DraftTree.chain(sid, t, d) for sid, t, d in zip(sequence_ids, tokens, distributions)]

    def _pick(self, logits: torch.Tensor, sampling: DraftSampling, generator: torch.Generator | None, max_top_k: int,
              tokens: list[int], distributions: list[Distribution]) -> None:
        """Appends the next draft token of logits [V']: argmax, or drawn from the sparse q sent with it."""
        if sampling.greedy:
            tokens.append(int(self.output.token_ids(torch.argmax(logits))))  # first maximum: ties go to the lowest id
            return
        ids, probs = sparse_distribution(logits, sampling, max_top_k)  # [k] draft-vocabulary indices, [k]
        ids = self.output.token_ids(ids)  # [k] token ids
        tokens.append(int(ids[int(torch.multinomial(probs, 1, generator=generator))]))
        distributions.append(Distribution(tuple(ids.tolist()), tuple(probs.tolist())))

    def tree(self, ctx: HeadContext, sequence_id: str, max_depth: int, max_nodes: int,
             top_k: int, temperature: float = 1.0) -> DraftTree:
        """An EAGLE-2 dynamic tree: see the module docstring."""
        return self.trees([ctx], [sequence_id], [max_depth], [max_nodes], top_k, [temperature])[0]

    @torch.inference_mode()
    def trees(self, ctxs: Sequence[HeadContext], sequence_ids: Sequence[str], max_depths: Sequence[int],
              max_nodes: Sequence[int], top_k: int, temperatures: Sequence[float] | None = None) -> list[DraftTree]:
        """`tree` for several sequences at once: one head forward per depth for every frontier, the
        cached keys padded to the longest context and the frontiers to the widest (padding masked).
        `temperatures`: per sequence, the temperature its draft probabilities (the nodes'
        confidence) are taken at: 1 for greedy requests, the request's own for sampled ones."""
        b = len(ctxs)
        scale = torch.tensor([1.0 / t for t in (temperatures or [1.0] * b)], device=self.device)  # [b]
        k, v, context = self._padded(ctxs)  # [b, heads, width, head_dim] x2, [b, width]: the row's own context
        width, context = k.shape[2], context.cpu()
        widths = [1 if nodes <= depth else top_k for depth, nodes in zip(max_depths, max_nodes)]
        cands = [_Candidates() for _ in ctxs]
        root = torch.softmax(self.output(torch.stack([c.last for c in ctxs])) * scale[:, None], -1)  # [b, V']
        for c, probs, w in zip(cands, root, widths):
            c.add_children(ROOT, 0, 1.0, probs, w, self.output.vocab)
        sources = [[ctx.last] * len(c.tokens) for ctx, c in zip(ctxs, cands)]  # per candidate: its predicted feature
        greedy = [[0] for _ in ctxs]
        levels = [list(range(len(c.tokens))) for c in cands]
        fed: list[list[int]] = [[] for _ in ctxs]  # per row: candidate of each scratch row, in order
        columns: list[list[int]] = [[] for _ in ctxs]  # per row: key column of each scratch row
        for depth in range(1, max(max_depths)):
            frontiers = [_frontier(c, level, path[-1], top_k) if depth < limit else []
                         for c, level, path, limit in zip(cands, levels, greedy, max_depths)]
            f = max(len(frontier) for frontier in frontiers)
            start = k.shape[2]  # key columns before this depth's rows
            ids = torch.zeros(b, f, dtype=torch.long, device=self.device)  # [b, f]
            feats = torch.zeros(b, f, ctxs[0].last.shape[-1], dtype=self.dtype, device=self.device)  # [b, f, hidden]
            pos = torch.zeros(b, f, dtype=torch.long, device=self.device)  # [b, f]
            mask = torch.zeros(b, f, start + f, dtype=torch.bool)  # [b, f, keys]
            mask[:, :, :width] = context[:, None, :]
            for i, frontier in enumerate(frontiers):
                n = len(frontier)
                if n:
                    ids[i, :n] = torch.tensor([cands[i].tokens[node] for node in frontier])
                    feats[i, :n] = torch.stack([sources[i][node] for node in frontier])
                    seen = _sees(cands[i], fed[i], frontier, 0, torch.device("cpu"))  # [n, fed + n]
                    mask[i, :n, columns[i] + [start + j for j in range(n)]] = seen
                pos[i] = ctxs[i].end - 1 + depth
                mask[i, torch.arange(n, f), start + torch.arange(n, f)] = True  # padding sees itself
            out, nk, nv = self.head(self.parts.embed(ids).to(self.dtype), feats, pos, k, v,
                                    mask[:, None].to(self.device))  # out [b, f, hidden]
            k, v = torch.cat([k, nk], dim=-2), torch.cat([v, nv], dim=-2)
            predicted = self.parts.final_norm(out)  # [b, f, hidden]
            probs = torch.softmax(self.output(predicted) * scale[:, None, None], -1)  # [b, f, V']
            for i, frontier in enumerate(frontiers):
                c = cands[i]
                fed[i] += frontier
                columns[i] += [start + j for j in range(len(frontier))]
                if not frontier:
                    continue
                levels[i] = []
                for row, node in enumerate(frontier):
                    c.expanded[node] = True
                    first = len(c.tokens)
                    c.add_children(node, depth, c.cum[node], probs[i, row], widths[i], self.output.vocab)
                    sources[i] += [predicted[i, row]] * (len(c.tokens) - first)
                    if node == greedy[i][-1]:
                        greedy[i].append(first)
                    levels[i] += range(first, len(c.tokens))
        trees = []
        for sid, c, path, depth, nodes in zip(sequence_ids, cands, greedy, max_depths, max_nodes):
            kept = _keep(c, path[:min(depth, nodes)], nodes)
            index = {node: i for i, node in enumerate(kept)}
            trees.append(DraftTree.from_nodes(sid, [c.tokens[i] for i in kept],
                                              [ROOT if c.parents[i] == ROOT else index[c.parents[i]] for i in kept]))
        return trees
