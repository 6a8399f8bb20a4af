"""The kernel protocol: the verbs every backend provides, one signature each.

A target step calls the verbs of one `Kernels` object, picked once (select.py):

  store   this step's keys and values into the paged pool (FP8 with per-entry scales, optionally);
  plan    per step and sliding window: which pool entries each query row sees, built once
          and read by every layer with that window;
  attend  every query row over the pool, given a plan;
  accept  a draft tree's longest accepted path: greedy, or lossless rejection sampling.

`paged_attention` is plan + attend in one checked call with the signature below: the
standalone kernel of each backend (reference, cpu, triton), which the tests compare.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

Tensor = torch.Tensor


class PagedAttention(Protocol):
    """The paged attention signature, the same in every backend (semantics: paged_attention.py)."""

    def __call__(
        self,
        query: Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: Tensor,  # [num_seqs, max_blocks_per_seq] int32
        context_lens: Tensor,  # [num_seqs] int32, committed kv entries before the new tokens
        query_start_loc: Tensor,  # [num_seqs + 1] int32, cumulative new-token counts
        query_positions: Tensor,  # [num_tokens] int32, absolute position of each new token
        scale: float,
        sliding_window: int | None = None,
        tree_mask: Tensor | None = None,  # [num_tokens, max_q_len] bool
        k_scale: Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
        v_scale: Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
    ) -> Tensor: ...  # [num_tokens, num_heads, head_dim], query.dtype


class PlanAttention(Protocol):
    """The plan of one step and sliding window (what it holds is the backend's business)."""

    def __call__(
        self,
        query: Tensor,  # [num_tokens, num_heads, head_dim] (its dtype and head_dim may pick the path)
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (block_size, dtype)
        block_tables: Tensor,  # [num_seqs, max_blocks_per_seq] int32
        context_lens: Tensor,  # [num_seqs] int32
        query_start_loc: Tensor,  # [num_seqs + 1] int32
        query_positions: Tensor,  # [num_tokens] int32
        sliding_window: int | None,
        tree_mask: Tensor | None,  # [num_tokens, max_q_len] bool
    ) -> Any: ...


class Attend(Protocol):
    """Attention over the pool given a plan of the same step and window."""

    def __call__(
        self,
        query: Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        plan: Any,
        scale: float,
        k_scale: Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
        v_scale: Tensor | None = None,
    ) -> Tensor: ...  # [num_tokens, num_heads, head_dim], query.dtype


class StoreKV(Protocol):
    def __call__(
        self,
        key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: Tensor,  # [num_tokens] int64, < 0 = skip
        k_scale: Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
        v_scale: Tensor | None = None,
    ) -> None: ...


class AcceptTreeGreedy(Protocol):
    def __call__(
        self,
        draft_tokens: Tensor,  # [S, max_nodes] int64 (node 0 = root token, unused)
        parents: Tensor,  # [S, max_nodes] int32/int64, parents[s, 0] = -1
        num_nodes: Tensor,  # [S] int32/int64, nodes incl. root
        target_argmax: Tensor,  # [S, max_nodes] int64, target's token after node n
    ) -> tuple[Tensor, Tensor, Tensor]: ...  # semantics: tree_accept.py


class AcceptTreeSampling(Protocol):
    def __call__(
        self,
        draft_tokens: Tensor,  # [S, max_nodes] int64
        parents: Tensor,  # [S, max_nodes] int32/int64
        num_nodes: Tensor,  # [S] int32/int64
        target_probs: Tensor,  # [S, max_nodes, vocab] f32, target distribution after node n
        draft_probs: Tensor,  # [S, max_nodes, vocab] f32, row n = q of n's children
        uniforms: Tensor,  # [S, max_nodes + 1] f32 in [0, 1); column c tests node c, last = bonus
    ) -> tuple[Tensor, Tensor, Tensor]: ...  # semantics: tree_accept.py
