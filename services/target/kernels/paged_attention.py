"""Paged attention over block tables (PyTorch reference + shared argument checks).

One call serves a mixed batch: prefill chunks, decode steps and verify trees of many
sequences, their new tokens flattened sequence after sequence in `query`.

Visibility for new token i of sequence s (i local to s, c = context_lens[s]):
  * committed kv slots j < c (sequence index j, position j), and
  * new-token kv slots c + k with k <= i (causal), or with tree_mask[row, k] True when a
    tree mask is given (row = global token index; ancestors-and-self of node i). A tree
    mask covers the whole batch: rows of prefill/decode sequences in a mixed batch
    must hold their causal pattern (True for k <= i); columns k >= q_len are ignored;
  * with a sliding window W: only kv entries whose position p_kv satisfies
    p_q - p_kv < W, where p_q = query_positions[row] and a new token's kv position is
    its own query position (transformers: kv_idx > q_idx - sliding_window).
A query row with no visible kv entry yields zeros. The cache may hold another float dtype
than the query (or FP8 with scales); the Triton kernel converts kv tiles to the query
dtype for its dots. GQA: query head h reads kv head
h // (num_heads // num_kv_heads). Softmax runs in float32; the output has query's dtype.
The keys/values of the new tokens must already be in the cache (store_kv first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._validate import FLOAT_DTYPES, check_kv_cache, check_tensor

MAX_HEAD_DIM = 256


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, committed kv entries before the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative new-token counts
    query_positions: torch.Tensor,  # [num_tokens] int32, absolute position of each new token
    scale: float,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,  # [num_tokens, max_q_len] bool
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
    v_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query.dtype
    """Attention of each new token over its sequence's paged KV (see module docstring)."""
    validate_paged_attention_args(
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, query_positions,
        scale, sliding_window, tree_mask, k_scale, v_scale,
    )
    plan = plan_paged_attention(k_cache.shape[1], block_tables, context_lens, query_start_loc,
                                query_positions, sliding_window, tree_mask)
    return paged_attention_planned(query, k_cache, v_cache, plan, scale, k_scale, v_scale)


@dataclass(frozen=True)
class AttentionPlan:
    """Index and mask tensors of one step's attention, the same for every layer that
    shares a sliding window: the engine builds it once per step and window, not per layer."""

    rows: torch.Tensor  # [num_seqs, max_q] global token index of new token i of s (0 if padding)
    q_valid: torch.Tensor  # [num_seqs, max_q] bool
    slots: torch.Tensor  # [num_seqs, max_kv] cache slot of kv entry j of s (0 if padding)
    mask: torch.Tensor  # [num_seqs, max_q, max_kv] bool visibility
    valid_flat: torch.Tensor | None = None  # [num_valid] indices into num_seqs * max_q (None: all, in order)
    dest_rows: torch.Tensor | None = None  # [num_valid] global token index of each valid row

    @property
    def empty(self) -> bool:
        return self.rows.numel() == 0


def plan_paged_attention(
    block_size: int,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    query_positions: torch.Tensor,  # [num_tokens] int32
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,  # [num_tokens, max_q_len] bool
) -> AttentionPlan:
    dev = block_tables.device
    num_seqs = block_tables.shape[0]
    starts = query_start_loc[:-1].long()  # [num_seqs]
    q_lens = query_start_loc[1:].long() - starts  # [num_seqs]
    ctx = context_lens.long()  # [num_seqs]
    max_q = int(q_lens.max()) if num_seqs else 0
    if max_q == 0:
        z = torch.zeros(num_seqs, 0, dtype=torch.long, device=dev)
        return AttentionPlan(z, z.bool(), z, torch.zeros(num_seqs, 0, 0, dtype=torch.bool, device=dev))
    max_kv = int((ctx + q_lens).max())
    # Pad queries per sequence: rows[s, i] = global token index of new token i of s.
    i_idx = torch.arange(max_q, device=dev)  # [max_q]
    q_valid = i_idx[None, :] < q_lens[:, None]  # [num_seqs, max_q]
    rows = torch.where(q_valid, starts[:, None] + i_idx[None, :], 0)  # [num_seqs, max_q]
    # Each sequence's kv entries 0 .. ctx + q_len - 1 through its block table.
    j_idx = torch.arange(max_kv, device=dev)  # [max_kv]
    kv_valid = j_idx[None, :] < (ctx + q_lens)[:, None]  # [num_seqs, max_kv]
    blk_col = (j_idx // block_size).clamp(max=block_tables.shape[1] - 1)  # [max_kv]
    blocks = block_tables.long()[:, blk_col]  # [num_seqs, max_kv]
    slots = torch.where(kv_valid, blocks * block_size + j_idx % block_size, 0)  # [num_seqs, max_kv]
    mask = _visibility(ctx, q_lens, q_valid, kv_valid, rows, query_positions, sliding_window, tree_mask)
    num_tokens = query_positions.shape[0]
    if num_seqs * max_q == num_tokens and bool(q_valid.all()):
        return AttentionPlan(rows, q_valid, slots, mask)  # padded order == token order
    valid_flat = q_valid.flatten().nonzero().squeeze(1)  # [num_valid]
    return AttentionPlan(rows, q_valid, slots, mask, valid_flat, rows.flatten()[valid_flat])


def paged_attention_planned(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query.dtype
    """The reference attention given a plan (no argument checks: the plan was built from checked ones)."""
    num_tokens, num_heads, head_dim = query.shape
    nkv = k_cache.shape[2]
    group = num_heads // nkv
    out = torch.zeros_like(query)
    if num_tokens == 0 or plan.empty:
        return out
    num_seqs, max_q = plan.rows.shape
    # Float32 math: CPU SDPA is slower in bf16 (docs/kernels.md).
    q = query[plan.rows].float().transpose(1, 2)  # [num_seqs, num_heads, max_q, head_dim]
    k = _gather_kv(k_cache, k_scale, plan.slots).transpose(1, 2)  # [num_seqs, nkv, max_kv, head_dim] f32
    v = _gather_kv(v_cache, v_scale, plan.slots).transpose(1, 2)  # [num_seqs, nkv, max_kv, head_dim] f32
    # Query head h reads kv head h // group (enable_gqa); padding rows may come out NaN and are dropped.
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=plan.mask[:, None], scale=scale, enable_gqa=group > 1)
    o = o.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)  # padded rows
    if plan.valid_flat is None:
        return o.to(query.dtype)
    return out.index_copy_(0, plan.dest_rows, o.index_select(0, plan.valid_flat).to(query.dtype))


def _gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, nkv, head_dim]
    scale: torch.Tensor | None,  # [num_blocks, block_size, nkv] f32, FP8 only
    slots: torch.Tensor,  # [num_seqs, max_kv] int64
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [num_seqs, max_kv, nkv, head_dim] in `dtype`
    nkv, head_dim = cache.shape[2], cache.shape[3]
    x = cache.view(-1, nkv, head_dim)[slots]
    if scale is not None:
        x = x.float() * scale.view(-1, nkv)[slots].unsqueeze(-1)
    return x.to(dtype)


def _visibility(
    ctx: torch.Tensor,  # [num_seqs] int64
    q_lens: torch.Tensor,  # [num_seqs] int64
    q_valid: torch.Tensor,  # [num_seqs, max_q] bool
    kv_valid: torch.Tensor,  # [num_seqs, max_kv] bool
    rows: torch.Tensor,  # [num_seqs, max_q] global token index
    query_positions: torch.Tensor,  # [num_tokens]
    sliding_window: int | None,
    tree_mask: torch.Tensor | None,  # [num_tokens, max_q_len] bool
) -> torch.Tensor:  # [num_seqs, max_q, max_kv] bool
    max_q, max_kv = q_valid.shape[1], kv_valid.shape[1]
    dev = ctx.device
    i_idx = torch.arange(max_q, device=dev)  # [max_q]
    j_idx = torch.arange(max_kv, device=dev)  # [max_kv]
    k_new = j_idx[None, :] - ctx[:, None]  # [num_seqs, max_kv] index among new tokens
    is_new = k_new >= 0  # [num_seqs, max_kv]
    if tree_mask is None:
        new_vis = k_new[:, None, :] <= i_idx[None, :, None]  # [num_seqs, max_q, max_kv]
    else:
        col = k_new.clamp(0, tree_mask.shape[1] - 1)  # [num_seqs, max_kv]
        new_vis = tree_mask[rows[:, :, None], col[:, None, :]]  # [num_seqs, max_q, max_kv]
    mask = q_valid[:, :, None] & kv_valid[:, None, :] & (~is_new[:, None, :] | new_vis)
    if sliding_window is not None:
        pos = query_positions.long()
        p_q = pos[rows]  # [num_seqs, max_q]
        starts = rows[:, :1]  # [num_seqs, 1] (row of new token 0; valid whenever q_len > 0)
        new_rows = (starts + k_new.clamp(min=0)).clamp(max=pos.shape[0] - 1)  # [num_seqs, max_kv]
        p_kv = torch.where(is_new, pos[new_rows], j_idx[None, :])  # [num_seqs, max_kv]
        mask &= (p_q[:, :, None] - p_kv[:, None, :]) < sliding_window
    return mask


def validate_paged_attention_args(
    query, k_cache, v_cache, block_tables, context_lens, query_start_loc, query_positions,
    scale, sliding_window, tree_mask, k_scale, v_scale,
) -> None:
    """Shared argument checks (reference and Triton); raises ValueError / TypeError."""
    check_tensor("query", query, [None, None, None], FLOAT_DTYPES, None, "[num_tokens, num_heads, head_dim]")
    num_tokens, num_heads, head_dim = query.shape
    dev = query.device
    _, _, nkv, _, is_fp8 = check_kv_cache(k_cache, v_cache, k_scale, v_scale, None, head_dim, dev)
    if num_heads % nkv != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({nkv})")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    check_tensor("block_tables", block_tables, [None, None], (torch.int32,), dev, "[num_seqs, max_blocks_per_seq]")
    num_seqs = block_tables.shape[0]
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables must have at least one column ([num_seqs, max_blocks_per_seq >= 1])")
    check_tensor("context_lens", context_lens, [num_seqs], (torch.int32,), dev, f"[num_seqs={num_seqs}]")
    check_tensor("query_start_loc", query_start_loc, [num_seqs + 1], (torch.int32,), dev, f"[num_seqs + 1={num_seqs + 1}]")
    check_tensor("query_positions", query_positions, [num_tokens], (torch.int32,), dev, f"[num_tokens={num_tokens}]")
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, [num_tokens, None], (torch.bool,), dev, f"[num_tokens={num_tokens}, max_q_len]")
        if tree_mask.shape[1] == 0 and num_tokens > 0:
            raise ValueError("tree_mask must have at least one column ([num_tokens, max_q_len >= 1])")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
