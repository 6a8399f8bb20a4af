"""Paged attention plugged into transformers' attention interface.

The model's own modules run (projections, norms, RoPE from explicit positions);
when they call attention, `paged_attention_forward` stores the new keys and
values into the engine's KV pool and attends over each sequence's blocks.
The per-step `AttentionMetadata` travels through the model's forward kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from services.target.kernels import huge_pages
from services.target.kernels.select import Kernels

ATTN_IMPLEMENTATION = "specmesh_paged"


@dataclass
class KVPool:
    """The KV tensors of all layers, allocated once. Owned by the model runner."""

    k_caches: list[torch.Tensor]  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    k_scales: list[torch.Tensor] | None  # per layer: [num_blocks, block_size, num_kv_heads] (fp8 only)
    v_scales: list[torch.Tensor] | None

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> "KVPool":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        fp8 = dtype == torch.float8_e4m3fn
        # On the CPU, 2 MB pages (kernels/huge_pages.py): attention reads blocks scattered over the pool.
        k = [huge_pages.zeros(shape, dtype, device) for _ in range(num_layers)]
        v = [huge_pages.zeros(shape, dtype, device) for _ in range(num_layers)]
        scales = (lambda: [torch.ones(shape[:3], dtype=torch.float32, device=device)
                           for _ in range(num_layers)]) if fp8 else (lambda: None)
        return cls(k, v, scales(), scales())

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(k_cache, v_cache, k_scale, v_scale) of one layer (scales None unless FP8)."""
        return (self.k_caches[index], self.v_caches[index], self.k_scales[index] if self.k_scales else None,
                self.v_scales[index] if self.v_scales else None)

    @property
    def num_bytes(self) -> int:
        tensors = [*self.k_caches, *self.v_caches, *(self.k_scales or []), *(self.v_scales or [])]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class AttentionMetadata:
    """What one forward pass needs to read and write the paged KV pool."""

    kv_pool: KVPool
    kernels: Kernels  # picked once by the model runner (services/target/kernels/select.py)
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32, KV entries before this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    query_positions: torch.Tensor  # [num_tokens] int32
    tree_mask: torch.Tensor | None = None  # [num_tokens, max_q_len] bool (verify passes)
    plans: dict = field(default_factory=dict)  # sliding window -> the kernels' plan of this step


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, sliding_window: int | None = None,
                            specmesh_meta: AttentionMetadata | None = None, **kwargs: Any):
    """query: [1, num_heads, num_tokens, head_dim]; key/value: [1, num_kv_heads, num_tokens, head_dim].

    Returns ([1, num_tokens, num_heads, head_dim], None) as transformers expects.
    """
    if specmesh_meta is None:
        raise RuntimeError("paged attention called without AttentionMetadata; "
                           "run the model through services.target.model.model_runner")
    q = query[0].transpose(0, 1).contiguous()  # [num_tokens, num_heads, head_dim]
    k = key[0].transpose(0, 1).contiguous()  # [num_tokens, num_kv_heads, head_dim]
    v = value[0].transpose(0, 1).contiguous()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = paged_attention(specmesh_meta, module.layer_idx, q, k, v, scale, sliding_window)
    return out.unsqueeze(0), None  # [1, num_tokens, num_heads, head_dim]


def paged_attention(meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Stores this step's keys and values of `layer` in the pool and attends over it.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], contiguous.
    Returns [num_tokens, num_heads, head_dim].
    """
    k_cache, v_cache, k_scale, v_scale = meta.kv_pool.layer(layer)
    kernels = meta.kernels
    plan = meta.plans.get(sliding_window)  # depends on the step and window, not the layer: once
    if plan is None:
        plan = meta.plans[sliding_window] = kernels.plan(
            q, k_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
            meta.query_positions, sliding_window, meta.tree_mask)
    if kernels.store_and_attend is not None and k_scale is None:
        out = kernels.store_and_attend(q, k, v, k_cache, v_cache, meta.slot_mapping, plan, scale)
        if out is not None:
            return out
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return kernels.attend(q, k_cache, v_cache, plan, scale, k_scale=k_scale, v_scale=v_scale)


def paged_attention_rows(meta: AttentionMetadata, rows: torch.Tensor, rows_meta: AttentionMetadata | None,
                         layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         sliding_window: int | None) -> torch.Tensor:
    """`paged_attention` for some rows only (services/target/model/output_rows.py): stores every row's
    keys and values as it does, then attends only rows `rows` ([K] int64) of q, whose own metadata
    is `rows_meta` (None where K = 0). -> [K, num_heads, head_dim]."""
    k_cache, v_cache, k_scale, v_scale = meta.kv_pool.layer(layer)
    kernels = meta.kernels
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    q = q.index_select(0, rows)  # [K, H, D]
    if rows_meta is None:
        return q
    plan = rows_meta.plans.get(sliding_window)
    if plan is None:
        plan = rows_meta.plans[sliding_window] = kernels.plan(
            q, k_cache, rows_meta.block_tables, rows_meta.context_lens, rows_meta.query_start_loc,
            rows_meta.query_positions, sliding_window, None)
    return kernels.attend(q, k_cache, v_cache, plan, scale, k_scale=k_scale, v_scale=v_scale)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # Masking is done inside paged attention from the metadata.
    return None


def register_paged_attention() -> str:
    """Registers the attention function and a no-op mask builder; returns the implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
