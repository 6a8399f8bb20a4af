"""Paged attention for the CPU: each sequence attends over its own blocks, read where they lie.

Same semantics and signature as `paged_attention_reference` (see paged_attention.py). The
reference pads every sequence of a step to the longest query and the longest context and
gathers every kv entry slot by slot for every layer, which dominated a busy step (numbers:
docs/kernels.md). Here, per step and sliding window, a plan records for each sequence only
the blocks it can see:

  * a sliding window drops whole blocks before the window (Gemma 3: 15 of 18 layers see
    at most 512 positions, however long the prompt);
  * blocks that lie consecutively in the pool are a view (no copy); others are gathered
    block by block (`index_select` of whole blocks, not per slot);
  * a decode row (one query, no tree) needs no mask: the kv range is sliced exactly;
  * prefill chunks and trees get a [q_len, kv_len] mask of their own (never padded).

Per layer the work is then one attention call per sequence, in one of two precisions:

  * float32 (float32 queries, or any cache that is not bf16): SDPA in float32, as the
    reference computes; float32 models stay token-exact against Hugging Face.
  * bf16 (bf16 queries over a bf16 cache, the engine's CPU default for bf16 models where the
    CPU multiplies bf16 natively): scaled scores and outputs are two bf16 matmuls (float32
    accumulation, each result rounded once to bf16) around a softmax computed in float32, the
    precision of Hugging Face's eager bf16 attention. For many rows CPU SDPA is no faster in
    bf16 than in float32, the matmuls are (2-3x). A lone decode row (one query, nothing
    masked) calls SDPA in bf16, which is faster at one query and keeps its scores in float32.

With the C++ row ops (a bf16 model on the AVX-512 kernel, `cpp_attention`), decode rows and
small trees attend in cpu_decode_attention.cpp, and on CPUs with AVX512-BF16 the prefill
chunks whose rows each see one run of entries (causal, with or without a sliding window) in
cpu_chunk_attention.cpp (VDPBF16PS, keys and values read once per piece from the pool),
faster than torch's matmuls.

Decode rows of a busy step are batched: per-sequence calls cost Python and dispatch time per
sequence per layer. Decode rows without a mask are grouped by kv length (a
group's longest is at most twice its shortest, so padding at most doubles the gathered
entries); each group is one block gather and one SDPA call with a padding mask, the query
heads of a kv head laid out as that head's query rows (GQA without expanding kv).

The measurements behind each choice: docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import functools

from . import cpu_kernels, cpu_linear, cpu_rowops
from .paged_attention import validate_paged_attention_args


@dataclass(frozen=True)
class SeqPlan:
    """Where one sequence's queries and visible kv entries are, for one step and window."""

    q_start: int  # first row of its new tokens in `query`
    q_len: int
    blocks: torch.Tensor | None  # [num_blocks] int64 to gather, or None when `first_block` + n is a run
    first_block: int  # block id of the run (only when blocks is None)
    num_blocks: int
    kv_offset: int  # first visible kv entry within the gathered blocks
    kv_len: int  # visible kv entries from kv_offset on
    mask: torch.Tensor | None  # [q_len, kv_len] bool, None when every entry is visible to the row
    hidden: torch.Tensor | None = field(default=None, compare=False, repr=False)  # ~mask (bf16 path)
    # [q_len] bool: rows that see some entry; None when every row does (no row to zero)
    seen: torch.Tensor | None = field(default=None, compare=False, repr=False)
    block_ids: tuple[int, ...] = field(default=(), compare=False, repr=False)  # the num_blocks ids read


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows of several sequences attended in one call (kv lengths within 2x of each other)."""

    members: tuple[int, ...]  # indices into the plan's SeqPlans
    rows: torch.Tensor  # [n] int64 query rows
    blocks: torch.Tensor  # [n * blocks_per_seq] int64 block ids, each sequence padded with its own first
    blocks_per_seq: int
    mask: torch.Tensor  # [n, 1, 1, blocks_per_seq * block_size] bool, True where the row sees the entry
    hidden: torch.Tensor  # [n, 1, 1, blocks_per_seq * block_size] bool, ~mask
    padding: torch.Tensor  # [num_padding] int64 gathered kv entries (of n * blocks_per_seq * block_size) masked out


class CpuAttentionPlan(list):
    """The SeqPlans of one step and window (a list), plus the decode groups among them."""

    groups: list[DecodeGroup]
    grouped: frozenset[int]
    decode_rows: "DecodeRows | None"  # set by _decode_rows on first use
    chunk_pieces: "ChunkPieces | None"  # set by _chunk_pieces on first use
    every_row_decode: bool  # set by every_row_decode on first use: decode rows cover every plan


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    query_positions: torch.Tensor,  # [num_tokens] int32
    scale: float,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,  # [num_tokens, max_q_len] bool
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query.dtype
    validate_paged_attention_args(
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, query_positions,
        scale, sliding_window, tree_mask, k_scale, v_scale,
    )
    plan = plan_cpu_attention(k_cache.shape[1], block_tables, context_lens, query_start_loc,
                              query_positions, sliding_window, tree_mask)
    return paged_attention_cpu_planned(query, k_cache, v_cache, plan, scale, k_scale, v_scale)


def plan_cpu_attention(
    block_size: int,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    query_positions: torch.Tensor,  # [num_tokens] int32
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,  # [num_tokens, max_q_len] bool
    cut_windows: bool = True,
) -> list[SeqPlan]:
    """One SeqPlan per sequence with new tokens (built once per step and window, read by every layer).
    cut_windows: long chunks of sliding-window layers in pieces of WINDOW_SUBCHUNK rows (for
    torch's matmuls; the C++ chunk kernel limits each row block's keys itself, and one piece
    packs its keys once, which is faster)."""
    tables = block_tables.tolist()
    ctx_lens = context_lens.tolist()
    starts = query_start_loc.tolist()
    positions = query_positions.tolist()
    plans = []
    for s, table in enumerate(tables):
        q_start, q_len, ctx = starts[s], starts[s + 1] - starts[s], ctx_lens[s]
        if q_len == 0:
            continue
        for r0, r1 in _row_ranges(q_start, q_len, sliding_window if cut_windows else None, tree_mask):
            plans.append(_seq_plan(block_size, table, ctx, q_start, q_len, r0, r1, positions,
                                   sliding_window, tree_mask))
    out = CpuAttentionPlan(plans)
    out.groups = _decode_groups(plans, block_size)
    out.grouped = frozenset(i for g in out.groups for i in g.members)
    return out


WINDOW_SUBCHUNK = 64  # query rows per attention call of a long chunk in a sliding-window layer


def _row_ranges(q_start: int, q_len: int, sliding_window: int | None,
                tree_mask: torch.Tensor | None) -> list[tuple[int, int]]:
    """Row ranges of one sequence's new tokens, each attended in its own call.

    In a sliding-window layer a long prefill chunk is cut into WINDOW_SUBCHUNK rows: each piece
    reads only its own window (64 + W - 1 entries instead of the chunk's q_len + W - 1) and
    computes no score it would mask (a third less time a layer). Trees are never cut (their
    rows are not causal).
    """
    if sliding_window is None or q_len <= 2 * WINDOW_SUBCHUNK:
        return [(0, q_len)]
    if tree_mask is not None:  # rows of a plain chunk in a step with trees are causal: cut them
        rows = tree_mask[q_start:q_start + q_len, :q_len]
        if rows.shape[1] < q_len or not torch.equal(rows, torch.ones_like(rows).tril()):
            return [(0, q_len)]
    return [(r, min(r + WINDOW_SUBCHUNK, q_len)) for r in range(0, q_len, WINDOW_SUBCHUNK)]


def _seq_plan(block_size: int, table: list[int], ctx: int, q_start: int, q_len: int, r0: int,
              r1: int, positions: list[int], sliding_window: int | None,
              tree_mask: torch.Tensor | None) -> SeqPlan:
    """The plan of new-token rows r0..r1-1 of one sequence (all its rows: 0..q_len)."""
    total = ctx + r1  # rows see new tokens only up to themselves (tree parents come first)
    lo = 0
    if sliding_window is not None:  # entry j (position j below ctx + r0) is visible iff p_q - j < W
        lo = min(max(0, min(positions[q_start + r0:q_start + r1]) - sliding_window + 1), ctx + r0)
    b0, b1 = lo // block_size, (total - 1) // block_size + 1
    ids = table[b0:b1]
    run = ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:]))
    mask = None
    if r1 - r0 > 1 or tree_mask is not None or sliding_window is not None:
        mask = _visibility(lo, ctx, q_start, q_len, positions, sliding_window, tree_mask, r0, r1)
        if r1 - r0 == 1 and bool(mask.all()):
            mask = None
    seen = None if mask is None else mask.any(-1)
    return SeqPlan(q_start + r0, r1 - r0, None if run else torch.tensor(ids, dtype=torch.long),
                   ids[0], len(ids), lo - b0 * block_size, total - lo, mask,
                   None if mask is None else ~mask,
                   None if seen is None or bool(seen.all()) else seen, tuple(ids))


def _decode_groups(plans: list[SeqPlan], block_size: int) -> list[DecodeGroup]:
    """Decode rows (one query, no mask) in groups of two or more whose kv lengths are within 2x."""
    decode = sorted((i for i, p in enumerate(plans) if p.q_len == 1 and p.mask is None),
                    key=lambda i: -plans[i].kv_len)
    groups, k = [], 0
    while k < len(decode):
        end = k + 1
        while end < len(decode) and 2 * plans[decode[end]].kv_len >= plans[decode[k]].kv_len:
            end += 1
        members = decode[k:end]
        k = end
        if len(members) < 2:
            continue
        width = max(plans[i].num_blocks for i in members)
        blocks, mask = [], torch.zeros(len(members), 1, 1, width * block_size, dtype=torch.bool)
        for row, i in enumerate(members):
            p, ids = plans[i], plans[i].block_ids
            blocks.extend(ids + (ids[0],) * (width - len(ids)))
            mask[row, 0, 0, p.kv_offset:p.kv_offset + p.kv_len] = True
        groups.append(DecodeGroup(tuple(members), torch.tensor([plans[i].q_start for i in members]),
                                  torch.tensor(blocks, dtype=torch.long), width, mask, ~mask,
                                  (~mask).flatten().nonzero().flatten()))
    return groups


def paged_attention_cpu_planned(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: list[SeqPlan],
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
    v_scale: torch.Tensor | None = None,
    cpp_attention: bool = False,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query.dtype
    """cpp_attention: a bf16 step's decode rows (one query, nothing masked) and the rows of small
    trees and chunks attend in one C++ call over the pool in place (kernels/
    cpu_decode_attention.cpp), and on AVX512-BF16 CPUs its prefill chunks in another
    (cpu_chunk_attention.cpp): the bf16 path's precision, its float32 sums in another order,
    instead of per group / per sequence torch calls."""
    if query.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16:
        return _attention_bf16(query, k_cache, v_cache, plan, scale, cpp_attention)
    out = torch.zeros_like(query)
    qf = query.float()
    grouped = getattr(plan, "grouped", frozenset())
    for g in getattr(plan, "groups", ()):
        o = _decode_group(qf, k_cache, v_cache, k_scale, v_scale, g, scale)  # [n, num_heads, head_dim]
        out.index_copy_(0, g.rows, o.to(query.dtype))
    for i, p in enumerate(plan):
        if i in grouped:
            continue
        o = _plan_float32(qf, k_cache, v_cache, k_scale, v_scale, p, scale)  # [q_len, num_heads, head_dim]
        out[p.q_start:p.q_start + p.q_len] = o.to(query.dtype)
    return out


def _plan_float32(
    qf: torch.Tensor,  # [num_tokens, num_heads, head_dim] f32 (or bf16: widened here)
    k_cache: torch.Tensor,  # [num_blocks, block_size, nkv, head_dim]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, nkv] f32, FP8 only
    v_scale: torch.Tensor | None,
    p: SeqPlan,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim] f32
    """One plan's rows attended in float32 (torch's SDPA over its kv range widened to float32)."""
    num_heads, nkv = qf.shape[1], k_cache.shape[2]
    k = _kv_range(k_cache, k_scale, p)  # [nkv, kv_len, head_dim] f32
    v = _kv_range(v_cache, v_scale, p)
    q = qf[p.q_start:p.q_start + p.q_len].float().transpose(0, 1)  # [num_heads, q_len, head_dim]
    o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       attn_mask=None if p.mask is None else p.mask[None, None],
                                       scale=scale, enable_gqa=num_heads != nkv)[0]
    o = o.transpose(0, 1)  # [q_len, num_heads, head_dim]
    if p.seen is not None:  # rows that see nothing are zeros (SDPA gives NaN there)
        o = torch.where(p.seen[:, None, None], o, 0.0)
    return o


def _decode_group(
    qf: torch.Tensor,  # [num_tokens, num_heads, head_dim] f32
    k_cache: torch.Tensor,  # [num_blocks, block_size, nkv, head_dim]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, nkv] f32, FP8 only
    v_scale: torch.Tensor | None,
    g: DecodeGroup,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim] f32
    n, (num_heads, head_dim), nkv = len(g.members), qf.shape[1:], k_cache.shape[2]
    kv_len = g.blocks_per_seq * k_cache.shape[1]

    def gather(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:  # [n, nkv, kv_len, D] f32
        x = cache.index_select(0, g.blocks)  # [n * blocks_per_seq, block_size, nkv, D], a fresh copy
        if scales is not None:
            x = x.float() * scales.index_select(0, g.blocks).unsqueeze(-1)
        x = x.float().view(n * kv_len, nkv * head_dim)
        # Padding reads slots this row may not see: stale entries of freed blocks, other requests'
        # KV. A masked score still meets its value (0 * NaN = NaN), so they are zeroed, never read.
        x.index_fill_(0, g.padding, 0.0)
        return x.view(n, kv_len, nkv, head_dim).transpose(1, 2)

    q = qf.index_select(0, g.rows).view(n, nkv, num_heads // nkv, head_dim)  # a kv head's query heads
    o = F.scaled_dot_product_attention(q, gather(k_cache, k_scale), gather(v_cache, v_scale),
                                       attn_mask=g.mask, scale=scale)  # [n, nkv, heads per kv, D]
    return o.reshape(n, num_heads, head_dim)


def store_and_attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] bf16
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 = skip
    plan: list[SeqPlan],
    scale: float,
) -> torch.Tensor | None:  # [num_tokens, num_heads, head_dim] bf16, or None: not here
    """A layer's store_kv and attention in one C++ call, where every row of the step is a decode row
    or a row of a small tree (cpu_decode_attention.cpp) and everything is bf16: the same stores and
    results as `store_kv_reference` then `paged_attention_cpu_planned(cpp_attention=True)`. A decode
    step's layer spends its time in the ~15 torch calls between the two otherwise (one row at 200
    tokens of context: 2.1 ms of attention a step, 0.65 of it the kernel). None where the plan has
    other rows (prefill chunks, large trees) or another dtype: the caller takes the two calls."""
    rows = every_row_decode(plan)
    if rows is None or not (query.dtype == key.dtype == value.dtype == k_cache.dtype == torch.bfloat16) \
            or slot_mapping.dtype != torch.long:
        return None
    return cpu_rowops.store_decode_attention(query.contiguous(), key.contiguous(), value.contiguous(), k_cache, v_cache,
                                             slot_mapping, *rows, scale)


def every_row_decode(plan: list[SeqPlan]) -> tuple | None:
    """The plan's DecodeRows tensors where every row of the step attends one by one in C++ (a decode
    row or a row of a small tree), else None; decided once per plan (kept on it)."""
    if getattr(plan, "every_row_decode", None) is False:
        return None
    rows = _decode_rows(plan)  # kept on the plan after its first call
    every = rows is not None and len(rows.plans) == len(plan)
    if isinstance(plan, CpuAttentionPlan):
        plan.every_row_decode = every
    return rows.tensors if every else None


def _attention_bf16(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] bf16
    k_cache: torch.Tensor,  # [num_blocks, block_size, nkv, head_dim] bf16
    v_cache: torch.Tensor,
    plan: list[SeqPlan],
    scale: float,
    cpp_attention: bool = False,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] bf16
    """Every plan and decode group as bf16 matmuls around a float32 softmax (module docstring);
    with cpp_attention, decode rows and small trees / chunks in one C++ call first."""
    num_heads, head_dim = query.shape[1:]
    nkv = k_cache.shape[2]
    group = num_heads // nkv  # query heads per kv head; query head h reads kv head h // group
    query = query.contiguous()
    out = torch.zeros_like(query)
    done = frozenset()
    if cpp_attention:
        rows = _decode_rows(plan)
        if rows is not None:
            cpu_rowops.decode_attention(query, k_cache, v_cache, *rows.tensors, scale, out)
            done = rows.plans
        chunks = _chunk_pieces(plan, done, chunk_kernel_runs(query.dtype, k_cache.dtype, head_dim, cpp_attention))
        if chunks is not None:
            cpu_rowops.chunk_attention(query, k_cache, v_cache, *chunks.tensors, scale, out)
            done = done | chunks.plans
    for g in ([] if cpp_attention else getattr(plan, "groups", ())):
        n, kv_len = len(g.members), g.blocks_per_seq * k_cache.shape[1]
        k = k_cache.index_select(0, g.blocks).view(n, kv_len, nkv, head_dim)
        v = v_cache.index_select(0, g.blocks).view(n * kv_len, nkv * head_dim)
        # Padding slots may hold anything (stale KV of freed blocks, NaN): masked scores become
        # -inf below, and values are zeroed (a zero probability times NaN would still be NaN).
        v.index_fill_(0, g.padding, 0.0)
        q = query.index_select(0, g.rows).view(n * nkv, group, head_dim)
        scores = _scores(q, k.permute(0, 2, 3, 1).reshape(n * nkv, head_dim, kv_len), scale)
        probs = _softmax(scores.view(n, nkv, group, kv_len), g.hidden)
        o = _matmul_bf16(probs, v.view(n, kv_len, nkv, head_dim).transpose(1, 2))  # [n, nkv, group, D]
        out.index_copy_(0, g.rows, o.reshape(n, num_heads, head_dim))
    grouped = done if cpp_attention else getattr(plan, "grouped", frozenset())
    emulated = emulated_bf16_matmul()
    for i, p in enumerate(plan):
        if i in grouped:
            continue
        if emulated and p.q_len >= FLOAT32_ROUTE_ROWS:
            # Prefill chunks and large trees where bf16 matmuls are emulated: the float32 path over
            # the pool widened (bf16 is exact in float32), what a float32 pool gives, without
            # rounding scores and probabilities to bf16 between float32 matmuls (a bf16 pool's
            # 2,000-token prefill on an AVX2 EPYC: 4.51 s that way against 4.34 s with a float32 pool).
            out[p.q_start:p.q_start + p.q_len] = _plan_float32(query, k_cache, v_cache, None, None, p,
                                                               scale).to(torch.bfloat16)
            continue
        k = _kv_range(k_cache, None, p, torch.bfloat16)  # [nkv, kv_len, D]
        v = _kv_range(v_cache, None, p, torch.bfloat16)
        q = query[p.q_start:p.q_start + p.q_len].transpose(0, 1)  # [num_heads, q_len, D]
        if p.mask is None:
            # A lone decode row: bf16 SDPA is faster at one query (up to ~1,500 entries).
            # A kv head's query heads are its query rows.
            o = F.scaled_dot_product_attention(q.reshape(1, nkv, group, head_dim), k[None], v[None],
                                               scale=scale)  # [1, nkv, group, D]
            out[p.q_start] = o.view(num_heads, head_dim)
            continue
        q = q.reshape(nkv, group * p.q_len, head_dim)  # a kv head's query heads, row after row
        scores = _scores(q, k.transpose(1, 2), scale)  # [nkv, group * q_len, kv_len]
        if cpp_attention:  # the mask and the softmax in one C++ pass (exp by polynomial)
            probs = cpu_rowops.masked_softmax_(scores.view(nkv * group, p.q_len, p.kv_len), p.hidden)
        else:
            probs = _softmax(scores.view(nkv, group, p.q_len, p.kv_len), p.hidden)
        probs = probs.view(nkv, group * p.q_len, p.kv_len)
        o = _matmul_bf16(probs, v).view(num_heads, p.q_len, head_dim).transpose(0, 1)  # [q_len, H, D]
        if p.seen is not None:  # rows that see nothing are zeros (their softmax is NaN)
            o = torch.where(p.seen[:, None, None], o, 0.0)
        out[p.q_start:p.q_start + p.q_len] = o
    return out


SMALL_QUERY_ROWS = 16  # rows of a tree or chunk that attend row by row in C++ (cpp_attention)
SMALL_QUERY_SCORES = 8192  # ... if their rows x visible range stays below this: per-row work
# grows with the range (no matrix blocking), torch's matmuls do not


@dataclass(frozen=True)
class DecodeRows:
    """The plan's rows that attend one by one in C++ (cpu_decode_attention.cpp): decode rows
    (one query, nothing masked) and the rows of small masked plans (draft trees, short chunks)."""
    plans: frozenset[int]  # indices of the plans they cover, wholly
    tensors: tuple  # rows [n], block tables [n, max_blocks], kv offsets [n], kv lens [n] int64; masks [n, w] bool or None


def _decode_rows(plan: list[SeqPlan]) -> DecodeRows | None:
    """Those rows, built once per step and window (kept on the plan), or None if there are none."""
    cached = getattr(plan, "decode_rows", False)
    if cached is not False:
        return cached
    picked = [i for i, p in enumerate(plan) if (p.q_len == 1 and p.mask is None) or (
        p.mask is not None and p.q_len <= SMALL_QUERY_ROWS and p.q_len * p.kv_len <= SMALL_QUERY_SCORES)]
    rows = None
    if picked:
        members = [(plan[i], r) for i in picked for r in range(plan[i].q_len)]  # (plan, row within it)
        width = max(p.num_blocks for p, _ in members)
        tables = torch.zeros(len(members), width, dtype=torch.long)
        masks = None
        if any(p.mask is not None for p, _ in members):
            masks = torch.zeros(len(members), max(p.kv_len for p, _ in members), dtype=torch.bool)
        for n, (p, r) in enumerate(members):
            tables[n, :p.num_blocks] = torch.tensor(p.block_ids, dtype=torch.long)
            if masks is not None:
                masks[n, :p.kv_len] = True if p.mask is None else p.mask[r]
        rows = DecodeRows(frozenset(picked), (
            torch.tensor([p.q_start + r for p, r in members], dtype=torch.long), tables,
            torch.tensor([p.kv_offset for p, _ in members], dtype=torch.long),
            torch.tensor([p.kv_len for p, _ in members], dtype=torch.long), masks))
    if isinstance(plan, CpuAttentionPlan):
        plan.decode_rows = rows
    return rows


@dataclass(frozen=True)
class ChunkPieces:
    """The plan's longer masked pieces whose rows each see one run of their kv range (prefill
    chunks, causal, with or without a sliding window): one VDPBF16PS call (cpu_chunk_attention.cpp)."""
    plans: frozenset[int]  # indices of the plans they cover
    tensors: tuple  # pieces [P, 4] (q_start, q_len, kv_offset, kv_len), tables [P, max_blocks], bounds [rows, 2] int64


def chunk_kernel_runs(query_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, cpp_attention: bool) -> bool:
    """Whether prefill chunks attend in cpu_chunk_attention.cpp (else torch's matmuls): with VDPBF16PS,
    or on AMX tiles where the CPU has them (cpu_linear.amx())."""
    return (cpp_attention and query_dtype == torch.bfloat16 and cache_dtype == torch.bfloat16
            and head_dim % 64 == 0 and cpu_linear.bf16_dot_instruction())


def whole_windows(query_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, cpp_attention: bool) -> bool:
    """Whether a sliding-window layer's long chunk attends whole (`plan_cpu_attention(cut_windows=False)`):
    where the C++ chunk kernel runs (it bounds each row block's keys itself), and where torch's bf16
    matmuls run on AMX tiles, which did a chunk's few large matmuls faster than its 64-row pieces
    (a 2,000-token prefill of the default model, 2-core Xeon, 2026-12-05: 533-553 ms whole against
    599-623 ms cut)."""
    return chunk_kernel_runs(query_dtype, cache_dtype, head_dim, cpp_attention) or (
        query_dtype == torch.bfloat16 and cache_dtype == torch.bfloat16 and cpu_kernels.amx_cpu())


def _chunk_pieces(plan: list[SeqPlan], skip: frozenset[int], kernel_runs: bool) -> ChunkPieces | None:
    """Those pieces (not in `skip`), built once per step and window (kept on the plan), or None:
    also where the kernel does not run here (`chunk_kernel_runs`; torch's matmuls then). A piece
    some row of which sees a non-contiguous set (a large draft tree) stays with torch too."""
    cached = getattr(plan, "chunk_pieces", False)
    if cached is not False:
        return cached
    picked, pieces, bounds = [], [], []
    if kernel_runs:
        for i, p in enumerate(plan):
            if i in skip or p.mask is None:
                continue
            seen = p.mask.sum(-1)  # [q_len]
            lo = torch.where(seen > 0, p.mask.to(torch.uint8).argmax(-1), 0)
            hi = torch.where(seen > 0, p.kv_len - p.mask.flip(-1).to(torch.uint8).argmax(-1), 0)
            if not torch.equal(hi - lo, seen):
                continue
            picked.append(i)
            pieces.append((p.q_start, p.q_len, p.kv_offset, p.kv_len))
            bounds.append(torch.stack([lo, hi], -1))
    chunks = None
    if picked:
        width = max(plan[i].num_blocks for i in picked)
        tables = torch.zeros(len(picked), width, dtype=torch.long)
        for n, i in enumerate(picked):
            tables[n, :plan[i].num_blocks] = torch.tensor(plan[i].block_ids, dtype=torch.long)
        chunks = ChunkPieces(frozenset(picked), (torch.tensor(pieces, dtype=torch.long), tables,
                                                 torch.cat(bounds).to(torch.long).contiguous()))
    if isinstance(plan, CpuAttentionPlan):
        plan.chunk_pieces = chunks
    return chunks


def _scores(q: torch.Tensor, k_t: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, M, D] @ [B, D, N] * scale in bf16: float32 accumulation, scaled, rounded once to bf16.
    (Scaling bf16 scores in float32 instead would cost a float32 copy of every score.)"""
    if q.dtype == torch.bfloat16 and q.shape[1] >= FLOAT32_ROUTE_ROWS and emulated_bf16_matmul():
        return (torch.bmm(q.float(), k_t.float()) * scale).to(torch.bfloat16)  # [B, M, N]
    zero = torch.zeros((), dtype=q.dtype).expand(q.shape[0], q.shape[1], k_t.shape[2])
    return torch.baddbmm(zero, q, k_t, beta=0, alpha=scale)  # [B, M, N] bf16


def _matmul_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 operands (batched): float32 accumulation, rounded once to bf16, as torch's
    bf16 matmul; where that matmul is emulated, through float32 operands (the same products, exact
    in float32, and one rounding)."""
    if a.dtype == torch.bfloat16 and a.shape[-2] >= FLOAT32_ROUTE_ROWS and emulated_bf16_matmul():
        return torch.matmul(a.float(), b.float()).to(torch.bfloat16)
    return torch.matmul(a, b)


# Query rows from which the float32 route pays: a prefill chunk's (2,000 tokens in 512-row
# chunks: 4.9 -> 3.4 s); decode groups (4 query heads a row) read keys and values once per few
# rows, and their float32 copies cost more than oneDNN's emulation saves (18 decode rows: ~5% slower).
FLOAT32_ROUTE_ROWS = 16


@functools.cache
def emulated_bf16_matmul() -> bool:
    """Whether torch's bf16 matmuls are emulated here: an x86 CPU without AVX512-BF16 or AMX, where
    oneDNN widens bf16 itself and a prefill chunk's attention ran 3x slower than in float32
    (132 against 44 ms for 4 heads x 512 queries x 2,000 keys on a 2-core AVX-512 Xeon)."""
    flags = cpu_kernels.cpu_flags()
    return cpu_kernels.avx2() and not {"avx512_bf16", "amx_bf16"} & flags


def _softmax(scores: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """bf16 probabilities of bf16 scores, normalised in float32 inside the kernel (as Hugging
    Face's eager attention does). `hidden` broadcasts over `scores`; True entries get zero."""
    if hidden is not None:
        scores = scores.masked_fill_(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _kv_range(
    cache: torch.Tensor,  # [num_blocks, block_size, nkv, head_dim]
    scale: torch.Tensor | None,  # [num_blocks, block_size, nkv] f32, FP8 only
    p: SeqPlan,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [nkv, kv_len, head_dim] in `dtype`
    def take(t: torch.Tensor) -> torch.Tensor:
        blocks = t.narrow(0, p.first_block, p.num_blocks) if p.blocks is None else t.index_select(0, p.blocks)
        return blocks.flatten(0, 1).narrow(0, p.kv_offset, p.kv_len)  # [kv_len, nkv, ...]
    x = take(cache)
    if scale is not None:
        x = x.float() * take(scale).unsqueeze(-1)
    return x.to(dtype).transpose(0, 1)


def _visibility(lo: int, ctx: int, q_start: int, q_len: int, positions: list[int],
                sliding_window: int | None, tree_mask: torch.Tensor | None,
                r0: int = 0, r1: int | None = None) -> torch.Tensor:  # [r1 - r0, ctx + r1 - lo] bool
    """The reference's visibility rule (paged_attention.py docstring) for new-token rows r0..r1-1
    over kv entries lo..ctx+r1-1."""
    r1 = q_len if r1 is None else r1
    j = torch.arange(lo, ctx + r1)  # [kv] kv index
    i = torch.arange(r0, r1)  # [rows] new-token index
    k_new = j - ctx  # [kv] index among new tokens (< 0: committed)
    if tree_mask is None:
        new_vis = k_new[None, :] <= i[:, None]  # [rows, kv]
    else:
        rows = tree_mask[q_start + r0:q_start + r1]  # [rows, max_q_len]
        new_vis = rows[:, k_new.clamp(0, rows.shape[1] - 1)]  # [rows, kv]
    mask = (k_new[None, :] < 0) | new_vis
    if sliding_window is not None:
        new_pos = torch.tensor(positions[q_start:q_start + q_len])  # [q_len] every new token's position
        p_kv = torch.where(k_new >= 0, new_pos[k_new.clamp(0, q_len - 1)], j)  # [kv]
        mask &= (new_pos[r0:r1, None] - p_kv[None, :]) < sliding_window
    return mask
