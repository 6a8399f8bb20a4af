"""Test helpers: build paged batches from dense per-sequence KV, draft trees, and a naive
dense attention written from the visibility rules (independent of the reference)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from services.target.kernels.kv_store import store_kv_reference

# Absolute/relative tolerances for Triton vs reference attention outputs, per query dtype.
ATTN_TOL = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


# ---------------------------------------------------------------- trees

def chain_tree(n: int) -> list[int]:
    return [-1] + list(range(n - 1))


def wide_tree(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


def binary_tree(n: int) -> list[int]:
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def unbalanced_tree(n: int) -> list[int]:
    """A long spine from the root with a few short side branches."""
    parents = [-1]
    spine = 0
    for i in range(1, n):
        if i % 3 == 0:
            parents.append(max(0, spine - 1))  # side branch off the spine
        else:
            parents.append(spine)
            spine = i
    return parents


def random_tree(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def depths(parents: list[int]) -> list[int]:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


# ---------------------------------------------------------------- paged batches

@dataclass
class SeqSpec:
    context_len: int
    q_len: int
    parents: list[int] | None = None  # tree over the new tokens (node 0 = root); None = causal


@dataclass
class PagedBatch:
    seqs: list[SeqSpec]
    num_heads: int
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, nkv, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    query_positions: torch.Tensor  # [num_tokens] int32
    tree_mask: torch.Tensor | None  # [num_tokens, max_q_len] bool
    k_dense: list[torch.Tensor] = field(default_factory=list)  # per seq [kv_len, nkv, hd] f32
    v_dense: list[torch.Tensor] = field(default_factory=list)
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def args(self, scale: float, sliding_window: int | None = None) -> dict:
        return dict(
            query=self.query, k_cache=self.k_cache, v_cache=self.v_cache, block_tables=self.block_tables,
            context_lens=self.context_lens, query_start_loc=self.query_start_loc,
            query_positions=self.query_positions, scale=scale, sliding_window=sliding_window,
            tree_mask=self.tree_mask, k_scale=self.k_scale, v_scale=self.v_scale,
        )


def make_batch(
    seqs: list[SeqSpec],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str = "cpu",
    use_tree_mask: bool = False,
    fp8: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Random dense KV per sequence, written into shuffled (gappy) blocks of a noisy cache."""
    kv_lens = [s.context_len + s.q_len for s in seqs]
    need = [max(1, math.ceil(n / block_size)) for n in kv_lens]
    num_blocks = sum(need) * 2 + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous block ids
    max_blocks = max(need) + 2
    # Unused table entries hold garbage: -1, huge ids, or valid-looking ids of other sequences.
    table = torch.randint(-1, num_blocks * 4, (len(seqs), max_blocks), generator=gen, dtype=torch.int32)
    cache_dtype = torch.float8_e4m3fn if fp8 else (cache_dtype or dtype)
    noise = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen) * 3
    k_cache, v_cache = noise[0].to(cache_dtype), noise[1].to(cache_dtype)
    k_scale = torch.rand((num_blocks, block_size, num_kv_heads), generator=gen) if fp8 else None
    v_scale = torch.rand((num_blocks, block_size, num_kv_heads), generator=gen) if fp8 else None
    store_dtype = torch.float32 if fp8 else cache_dtype
    k_dense, v_dense, slots_all, k_all, v_all = [], [], [], [], []
    for s, n in enumerate(kv_lens):
        blocks = [perm.pop() for _ in range(need[s])]
        table[s, : need[s]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(store_dtype)
        v = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(store_dtype)
        slots_all.append(torch.tensor([blocks[j // block_size] * block_size + j % block_size for j in range(n)]))
        k_all.append(k)
        v_all.append(v)
        k_dense.append(k.float())
        v_dense.append(v.float())
    store_kv_reference(torch.cat(k_all), torch.cat(v_all), k_cache, v_cache, torch.cat(slots_all).long(), k_scale, v_scale)
    if fp8:  # the dense copies the naive attention sees: what the cache holds, dequantized
        for s in range(len(seqs)):
            sl = slots_all[s]
            ks, vs = k_scale.view(-1, num_kv_heads)[sl], v_scale.view(-1, num_kv_heads)[sl]
            k_dense[s] = k_cache.view(-1, num_kv_heads, head_dim)[sl].float() * ks[..., None]
            v_dense[s] = v_cache.view(-1, num_kv_heads, head_dim)[sl].float() * vs[..., None]

    q_lens = [s.q_len for s in seqs]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    positions, rows = [], []
    max_q = max(max(q_lens), 1)
    for s in seqs:
        d = depths(s.parents) if s.parents is not None else list(range(s.q_len))
        positions += [s.context_len + x for x in d]
        for i in range(s.q_len):
            vis = ancestors_or_self(s.parents, i) if s.parents is not None else set(range(i + 1))
            rows.append([k in vis for k in range(max_q)])
    num_tokens = sum(q_lens)
    query = torch.randn((num_tokens, num_heads, head_dim), generator=gen).to(dtype)
    tree_mask = torch.tensor(rows, dtype=torch.bool).view(num_tokens, max_q) if use_tree_mask else None
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return PagedBatch(
        seqs=seqs, num_heads=num_heads, query=to(query), k_cache=to(k_cache), v_cache=to(v_cache),
        block_tables=to(table), context_lens=to(torch.tensor([s.context_len for s in seqs], dtype=torch.int32)),
        query_start_loc=to(qsl), query_positions=to(torch.tensor(positions, dtype=torch.int32)),
        tree_mask=to(tree_mask), k_dense=k_dense, v_dense=v_dense, k_scale=to(k_scale), v_scale=to(v_scale),
    )


def naive_attention(batch: PagedBatch, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Dense attention token by token, head by head, from the rules in the contract."""
    out = torch.zeros(batch.query.shape, dtype=torch.float32)
    q_all = batch.query.float().cpu()
    nkv = batch.k_cache.shape[2]
    group = batch.num_heads // nkv
    row = 0
    for s, spec in enumerate(batch.seqs):
        mask = visible_mask(batch, s, sliding_window)  # [q_len, kv_len]
        for i in range(spec.q_len):
            visible = mask[i].nonzero().flatten().tolist()
            for h in range(batch.num_heads):
                if not visible:
                    continue
                k = batch.k_dense[s][visible, h // group]  # [n_vis, hd]
                v = batch.v_dense[s][visible, h // group]
                w = torch.softmax((k @ q_all[row + i, h]) * scale, dim=0)
                out[row + i, h] = w @ v
        row += spec.q_len
    return out


def visible_mask(batch: PagedBatch, s: int, sliding_window: int | None) -> torch.Tensor:
    """[q_len, kv_len] bool: which kv entries each new token of sequence s may see (the contract)."""
    spec = batch.seqs[s]
    c = spec.context_len
    pos_new = [c + x for x in (depths(spec.parents) if spec.parents is not None else range(spec.q_len))]
    mask = torch.zeros(spec.q_len, c + spec.q_len, dtype=torch.bool)
    for i in range(spec.q_len):
        vis_new = ancestors_or_self(spec.parents, i) if spec.parents is not None else set(range(i + 1))
        for j in range(c + spec.q_len):
            p_kv = j if j < c else pos_new[j - c]
            ok = j < c or (j - c) in vis_new
            if sliding_window is not None and pos_new[i] - p_kv >= sliding_window:
                ok = False
            mask[i, j] = ok
    return mask


# ---------------------------------------------------------------- bf16 attention checks
def run_cpu_planned(batch: "PagedBatch", sliding_window: int | None, cpp_attention: bool,
                    scale: float = 0.3) -> tuple[torch.Tensor, list]:
    """The CPU paged attention of a batch through its step plan: (output, plan)."""
    from services.target.kernels.paged_attention_cpu import paged_attention_cpu_planned, plan_cpu_attention
    plan = plan_cpu_attention(batch.k_cache.shape[1], batch.block_tables, batch.context_lens,
                              batch.query_start_loc, batch.query_positions, sliding_window, batch.tree_mask)
    out = paged_attention_cpu_planned(batch.query, batch.k_cache, batch.v_cache, plan, scale,
                                      cpp_attention=cpp_attention)
    return out, plan


def plan_rows(plan: list, indices) -> list[int]:
    """The query rows of the plan's pieces `indices`."""
    return [r for i in sorted(indices) for r in range(plan[i].q_start, plan[i].q_start + plan[i].q_len)]


def assert_within_bf16_rounding(ours: torch.Tensor, eager: torch.Tensor, rows: list[int], equal_share: float) -> None:
    """Scores, probabilities and outputs rounded to bf16 where the eager bf16 attention rounds
    them, only float32 sums in another order: `rows` within a few bf16 steps of it, and at
    least `equal_share` of their outputs equal."""
    torch.testing.assert_close(ours[rows].float(), eager[rows].float(), atol=0.03, rtol=0.03)
    assert (ours[rows] == eager[rows]).float().mean().item() > equal_share


def assert_no_further_from_float32(ours: torch.Tensor, before: torch.Tensor, batch: "PagedBatch", scale: float,
                                   sliding_window: int | None, mean_factor: float) -> None:
    """Against float32 attention, `ours` no further off than the torch bf16 path `before` (at
    head_dim 256 both are past the small-shape bf16 tolerance: their scores are rounded to bf16)."""
    exact = naive_attention(batch, scale, sliding_window).float()
    ours_err, before_err = (ours.float() - exact).abs(), (before.float() - exact).abs()
    assert ours_err.max() <= 1.25 * before_err.max() and ours_err.mean() <= mean_factor * before_err.mean()
