"""Paged attention, Triton version (same signature and semantics as
paged_attention.paged_attention_reference; see that module for the visibility rules).

Work split: one program per (query tile, kv head). A query tile is BLOCK_Q new tokens
of ONE sequence times the GROUP_PAD query heads that share the kv head, flattened into
BLOCK_M = BLOCK_Q * GROUP_PAD rows, so each kv tile is loaded once for the whole group
(GQA). The grid has num_tokens // BLOCK_Q + num_seqs tiles, an upper bound on the tiles
all sequences need; each program finds its sequence by binary search over
query_start_loc (no host sync), and spare programs exit at once. Programs stream the
sequence's kv entries through the block table in BLOCK_N tiles with an online softmax
in float32 (exp2 with log2(e) folded into the scale). Tiles wholly before the sliding
window, or (causal case) after the tile's last query token, are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from ._validate import FP8_DTYPE
from .paged_attention import validate_paged_attention_args

LOG2E = 1.4426950408889634


def paged_attention_triton(
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
    v_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query.dtype
    """Attention of each new token over its sequence's paged KV."""
    validate_paged_attention_args(
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, query_positions,
        scale, sliding_window, tree_mask, k_scale, v_scale,
    )
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, nkv, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = _launch_config(num_tokens, num_seqs, num_heads // nkv, head_dim)
    is_fp8 = k_cache.dtype == FP8_DTYPE
    # Triton 3.9's interpreter multiplies bf16 tiles as raw uint16 (wrong results), so
    # under the interpreter the dots run on f32 copies; on GPUs they use the native dtype.
    upcast = bool(knobs.runtime.interpret)
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, nkv)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        # Without FP8 the kernel never reads the scale pointers (USE_FP8 is a compile-time
        # False); Triton still needs a tensor in each pointer slot, so pass the query.
        k_scale if is_fp8 else query,
        v_scale if is_fp8 else query,
        block_tables,
        context_lens,
        query_start_loc,
        query_positions,
        tree_mask.view(torch.uint8) if tree_mask is not None else query,
        float(scale) * LOG2E,
        int(sliding_window or 0),
        num_seqs,
        block_tables.shape[1],
        tree_mask.shape[1] if tree_mask is not None else 0,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=nkv,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        QUERIES_PER_KV=num_heads // nkv,
        USE_TREE_MASK=tree_mask is not None,
        USE_SLIDING_WINDOW=sliding_window is not None,
        USE_FP8=is_fp8,
        UPCAST_DOT=upcast,
        DOT_PRECISION="ieee" if upcast or query.dtype == torch.float32 else "tf32",
        **cfg,
    )
    return out


def _launch_config(num_tokens: int, num_seqs: int, group: int, head_dim: int) -> dict:
    """Tile sizes from shapes only (no host sync). tl.dot needs every dim >= 16."""
    group_pad = triton.next_power_of_2(group)
    decode_only = num_tokens == num_seqs  # every sequence has one new token (in practice)
    big_head = head_dim > 128
    block_m = max(16, group_pad) if decode_only else (32 if big_head else 64)
    block_m = max(block_m, group_pad)
    return {
        "GROUP_PAD": group_pad,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group_pad,
        "BLOCK_N": 32 if big_head else 64,
        "num_warps": 8 if big_head and not decode_only else 4,
    }


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile_idx, BLOCK_Q: tl.constexpr):
    """Sequence s whose tile range [qsl[s] // BLOCK_Q + s, ...) contains tile_idx."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM]
    query_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    k_scale_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS] f32 (USE_FP8 only)
    v_scale_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS] f32 (USE_FP8 only)
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] i32
    context_lens_ptr,  # [num_seqs] i32
    query_start_loc_ptr,  # [num_seqs + 1] i32
    query_positions_ptr,  # [num_tokens] i32
    tree_mask_ptr,  # [num_tokens, max_q_len] u8 (USE_TREE_MASK only)
    scale_log2,  # f32: attention scale * log2(e)
    sliding_window,  # i32 (USE_SLIDING_WINDOW only)
    num_seqs,  # i32
    max_blocks_per_seq,  # i32
    max_q_len,  # i32: tree_mask row stride
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TREE_MASK: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr,
    USE_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, num_seqs, tile_idx, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile_idx - (q_start // BLOCK_Q + seq)  # tile index within the sequence
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    q_local = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] new-token index in seq
    head = kv_head * QUERIES_PER_KV + offs_m % GROUP_PAD  # [BLOCK_M]
    row_valid = (q_local < q_len) & (offs_m % GROUP_PAD < QUERIES_PER_KV)  # [BLOCK_M]
    token = (q_start + q_local).to(tl.int64)  # [BLOCK_M] global token index
    d_valid = offs_d < HEAD_DIM  # [HEAD_DIM_PAD]
    q_offs = token[:, None] * (NUM_HEADS * HEAD_DIM) + head[:, None] * HEAD_DIM + offs_d[None, :]
    q_mask = row_valid[:, None] & d_valid[None, :]  # [BLOCK_M, HEAD_DIM_PAD]
    q = tl.load(query_ptr + q_offs, mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos = tl.load(query_positions_ptr + token, mask=row_valid, other=0)  # [BLOCK_M]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # kv range: [lo, hi) in sequence indices.
    if USE_TREE_MASK:
        hi = context_len + q_len
    else:
        hi = context_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    lo = 0
    if USE_SLIDING_WINDOW:
        # Committed entries j (position j) with j <= min(p_q) - W are invisible to all rows.
        min_pos = tl.min(tl.where(row_valid, q_pos, 2147483647), axis=0)
        lo = tl.maximum(tl.minimum(min_pos - sliding_window + 1, context_len), 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * max_blocks_per_seq
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] sequence indices
        kv_valid = offs_n < hi  # [BLOCK_N]
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + offs_n % BLOCK_SIZE  # [BLOCK_N]
        kv_offs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = kv_valid[:, None] & d_valid[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        if USE_FP8:
            scale_offs = slot * NUM_KV_HEADS + kv_head  # [BLOCK_N]
            ks = tl.load(k_scale_ptr + scale_offs, mask=kv_valid, other=0.0)  # [BLOCK_N]
            vs = tl.load(v_scale_ptr + scale_offs, mask=kv_valid, other=0.0)  # [BLOCK_N]
            k = k.to(tl.float32) * ks[:, None]
            v = v.to(tl.float32) * vs[:, None]
        k = k.to(q.dtype)  # no-op when the cache has the query's dtype (and UPCAST_DOT: f32)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]

        # Visibility (see paged_attention.py): committed entries, then causal/tree new ones.
        k_new = offs_n - context_len  # [BLOCK_N] index among the new tokens
        is_new = k_new >= 0  # [BLOCK_N]
        is_committed = k_new < 0  # [BLOCK_N]
        if USE_TREE_MASK:
            tm_offs = token[:, None] * max_q_len + k_new[None, :]
            tm_mask = row_valid[:, None] & (is_new & kv_valid)[None, :]
            new_vis = tl.load(tree_mask_ptr + tm_offs, mask=tm_mask, other=0) != 0
        else:
            new_vis = k_new[None, :] <= q_local[:, None]  # [BLOCK_M, BLOCK_N]
        visible = row_valid[:, None] & kv_valid[None, :] & (is_committed[None, :] | new_vis)
        if USE_SLIDING_WINDOW:
            new_pos = tl.load(query_positions_ptr + q_start + k_new, mask=is_new & kv_valid, other=0)
            kv_pos = tl.where(is_new, new_pos, offs_n)  # [BLOCK_N]
            visible = visible & ((q_pos[:, None] - kv_pos[None, :]) < sliding_window)
        s = tl.where(visible, s, float("-inf"))

        # Online softmax; a row with nothing visible yet keeps m = -inf and p = 0.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
