"""A lean forward's decoder layer for a step of decode rows in one C++ call (cpu_decode_layer.cpp).

A decode step's layer is nine kernel calls (qkv, q/k norm + RoPE, store + attention, o, add + norm,
gate|up, the activation, down, add + norm), each with its Python wrappers, argument checks and a
release and re-take of the GIL (py-spy of the engine thread, default model, one row: 18% of its
samples outside specmesh's kernels with the nine calls, 13% with the one call). `decode_layer_bf16` makes
the same calls with the same arguments in the same order from C++, so its outputs are the loop's
bit for bit (tests/target/test_decode_layer.py). It runs where every row of the step attends as a
decode row in C++ (store_and_attend's case: bf16 pool, no FP8 scales) and every linear of the
layer is one of specmesh's kernels without AMX at that many rows (a bias rides as the panels' extra
input column, as AVX512LinearBF16 carries Qwen2's q/k/v bias). `SPECMESH_FUSED_DECODE_LAYER=0`
keeps the nine calls (an A/B switch for benchmarks).
"""

from __future__ import annotations

import functools
import os

import torch

from services.target.kernels import cpu_linear
from services.target.kernels.cpu_kernels import module
from services.target.kernels.paged_attention_cpu import every_row_decode
from services.target.model.attention import AttentionMetadata
from services.target.model.gguf_weights import GGUFLinear
from services.target.model.linear import AVX512LinearBF16

_EMPTY = torch.empty(0)  # "not these parts" to the C++ side
_NO_MASK = torch.empty(0, dtype=torch.bool)


@functools.cache
def _dot() -> bool:
    return cpu_linear.bf16_dot_instruction()


def enabled() -> bool:
    return os.environ.get("SPECMESH_FUSED_DECODE_LAYER", "1") != "0"


def linear_parts(linear, rows: int) -> tuple[list[torch.Tensor], int, int] | None:
    """([quants, scales, offsets, panels], outputs, inputs) for the C++ layer to multiply `linear` (a
    lean forward's `direct_rows` callable) at `rows` rows as its own matmul_rows would, or None where
    it cannot. inputs past the layer's own: the panels' bias column and its zero padding."""
    owner = getattr(linear, "__self__", None)  # the module of a bound matmul_rows
    if not isinstance(owner, (GGUFLinear, AVX512LinearBF16)) or owner.out_dtype not in (None, torch.bfloat16):
        return None  # another kernel (or none), or another output dtype
    inputs = owner.extended if isinstance(owner, AVX512LinearBF16) else owner.in_features
    if cpu_linear.takes_amx(rows, inputs):
        return None  # the AMX tile path: not taken here
    if isinstance(owner, GGUFLinear) and (owner.panels is None or rows <= owner.block_rows):
        p = owner.packed
        return [p.quants, p.scales, p.offsets, _EMPTY], owner.out_features, inputs
    return [_EMPTY, _EMPTY, _EMPTY, owner.panels], owner.out_features, inputs


def layer_parts(linears: tuple, rows: int) -> tuple[list[torch.Tensor], list[int]] | None:
    """The four linears (qkv, o, gate|up, down) of a layer as the C++ call takes them: 16 tensors and
    (outputs, inputs) per linear; or None."""
    parts, dims = [], []
    for linear in linears:
        p = linear_parts(linear, rows)
        if p is None:
            return None
        parts += p[0]
        dims += p[1:]
    return parts, dims


class LayerParts:
    """A lean forward's layers' linears as the one call takes them, per row count (kept: a step's
    rows take the same parts every time), or None where some linear cannot go (or the switch is off)."""

    def __init__(self, layers: list[tuple]) -> None:
        self.layers = layers  # per layer: (qkv, o, gate|up, down) `direct_rows` callables
        self._by_rows: dict[int, list | None] = {}

    def __call__(self, rows: int) -> list | None:
        if not enabled():
            return None
        if rows not in self._by_rows:
            parts = [layer_parts(linears, rows) for linears in self.layers]
            self._by_rows[rows] = None if any(p is None for p in parts) else parts
        return self._by_rows[rows]

    @staticmethod
    def attention(fused: list | None, read, i: int, meta: AttentionMetadata, layer: int, head_dim: int,
                  sliding_window: int | None) -> tuple | None:
        """attention_args for layer i of a step whose parts are `fused` (None: the nine calls), or None
        where the layer keeps its nine calls (the last layer of a step that reads only some rows)."""
        if fused is None or (read is not None and i == len(fused) - 1):
            return None
        return attention_args(meta, layer, head_dim, sliding_window)


def attention_args(meta: AttentionMetadata, layer: int, head_dim: int, sliding_window: int | None) -> tuple | None:
    """(k_cache, v_cache, slot_mapping, rows, tables, offsets, lens, masks) where every row of the step
    attends in store_decode_attention's one C++ call for this layer, else None (the layer's own path)."""
    kernels = meta.kernels
    k_cache, v_cache, k_scale, _ = meta.kv_pool.layer(layer)
    if (kernels.store_and_attend is None or k_scale is not None or k_cache.dtype != torch.bfloat16
            or meta.slot_mapping.dtype != torch.long):
        return None
    plan = meta.plans.get(sliding_window)
    if plan is None:  # as paged_attention plans it (the plan reads the query's dtype and head size only)
        query = torch.empty(0, 1, head_dim, dtype=torch.bfloat16)
        plan = meta.plans[sliding_window] = kernels.plan(
            query, k_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, meta.query_positions,
            sliding_window, meta.tree_mask)
    rows = every_row_decode(plan)
    if rows is None:
        return None
    *tensors, masks = rows
    return (k_cache, v_cache, meta.slot_mapping, *tensors, _NO_MASK if masks is None else masks)


def decode_layer(x: torch.Tensor, h: torch.Tensor, parts: tuple[list[torch.Tensor], list[int]],
                 qk_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 attention: tuple, scale: float, post_attention_norm: torch.Tensor | None,
                 pre_feedforward_norm: torch.Tensor, post_feedforward_norm: torch.Tensor | None,
                 next_norm: torch.Tensor, eps: float, weight_after: bool = False, gelu_tanh: bool = True,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer: x [T, hidden] (its normed input), h [T, hidden] (the residual) -> (h, next layer's x)."""
    linears, dims = parts
    return module().decode_layer_bf16(
        x, h, linears, dims, _dot(), _EMPTY if qk_norm is None else qk_norm, cos, sin, heads, kv_heads,
        *attention, scale, _EMPTY if post_attention_norm is None else post_attention_norm, pre_feedforward_norm,
        _EMPTY if post_feedforward_norm is None else post_feedforward_norm, next_norm, eps, weight_after, gelu_tanh)
