"""KV store, Triton version (same signature and results as kv_store.store_kv_reference).

One program per new token writes all kv heads of its key and value rows into the slot
given by slot_mapping (skipping slots < 0), cast to the cache dtype. For an FP8 cache it computes one scale per
token per kv head (amax / 448) and rounds to e4m3 itself (round-to-nearest-even, with
the carry into the exponent) so the stored bytes match the PyTorch reference exactly;
the final cast then only converts already-representable values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_store import FP8_MAX, FP8_MIN_AMAX, validate_store_kv_args


def store_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 = skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
    v_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, FP8 only
) -> None:
    """Write key/value rows into the cache slots given by slot_mapping (in place)."""
    num_tokens, is_fp8 = validate_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if num_tokens == 0:
        return
    _, _, nkv, hd = k_cache.shape
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        # Without FP8 the kernel never reads the scale pointers (USE_FP8 is a compile-time
        # False); Triton still needs a tensor in each pointer slot, so pass the caches.
        k_scale if is_fp8 else k_cache,
        v_scale if is_fp8 else v_cache,
        slot_mapping,
        NUM_KV_HEADS=nkv,
        HEAD_DIM=hd,
        HEADS_PAD=triton.next_power_of_2(nkv),
        HEAD_DIM_PAD=triton.next_power_of_2(hd),
        USE_FP8=is_fp8,
        ROUND_TO_BF16=k_cache.dtype == torch.bfloat16 and key.dtype != torch.bfloat16,
        FP8_MAX=FP8_MAX,
        FP8_MIN_AMAX=FP8_MIN_AMAX,
    )


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    value_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM]
    k_scale_ptr,  # [num_blocks, block_size, NUM_KV_HEADS] f32 (USE_FP8 only)
    v_scale_ptr,  # [num_blocks, block_size, NUM_KV_HEADS] f32 (USE_FP8 only)
    slot_mapping_ptr,  # [num_tokens]
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_FP8: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MIN_AMAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
        offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [HEADS_PAD, HEAD_DIM_PAD]
        row = offs_h[:, None] * HEAD_DIM + offs_d[None, :]  # [HEADS_PAD, HEAD_DIM_PAD]
        src = token * (NUM_KV_HEADS * HEAD_DIM) + row
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + row
        k = tl.load(key_ptr + src, mask=mask, other=0.0)  # [HEADS_PAD, HEAD_DIM_PAD]
        v = tl.load(value_ptr + src, mask=mask, other=0.0)  # [HEADS_PAD, HEAD_DIM_PAD]
        if USE_FP8:
            scale_mask = offs_h < NUM_KV_HEADS  # [HEADS_PAD]
            k_q, k_s = _quantize_rows(k.to(tl.float32), FP8_MAX, FP8_MIN_AMAX)
            v_q, v_s = _quantize_rows(v.to(tl.float32), FP8_MAX, FP8_MIN_AMAX)
            tl.store(k_cache_ptr + dst, k_q.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v_q.to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_scale_ptr + slot * NUM_KV_HEADS + offs_h, k_s, mask=scale_mask)
            tl.store(v_scale_ptr + slot * NUM_KV_HEADS + offs_h, v_s, mask=scale_mask)
        else:
            if ROUND_TO_BF16:  # explicit RTNE (Triton's interpreter truncates f32 -> bf16)
                k = _round_to_bf16(k.to(tl.float32))
                v = _round_to_bf16(v.to(tl.float32))
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x, FP8_MAX: tl.constexpr, FP8_MIN_AMAX: tl.constexpr):
    """x [R, D] f32 -> (x / scale rounded to e4m3 values, as f32 [R, D]; scale [R] f32)."""
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    # div_rn: IEEE division like PyTorch ('/' is approximate on NVIDIA GPUs).
    scale = tl.math.div_rn(tl.maximum(amax, FP8_MIN_AMAX), tl.full([1], FP8_MAX, tl.float32))  # [R]
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return _round_to_e4m3(y), scale


@triton.jit
def _round_to_bf16(x):
    """Round f32 values to the nearest bf16 value (ties to even), as f32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3(x):
    """Round f32 values in [-448, 448] to the nearest e4m3 value (ties to even), as f32."""
    # Normal range: keep 3 of 23 mantissa bits; the add carries into the exponent.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormal range (|x| < 2**-6): multiples of 2**-9; 24576 has an f32 ulp of 2**-9.
    ax = tl.abs(x)
    sub = (ax + 24576.0) - 24576.0
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(ax < 0.015625, sub, normal)
