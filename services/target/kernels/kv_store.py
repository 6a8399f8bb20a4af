"""KV store: write new keys and values into their paged-KV slots (PyTorch reference).

Terms:
  slot     = block_id * block_size + offset; a slot < 0 means "skip this token"
             (padding tokens, or tokens whose KV must not be stored).
  FP8 KV   = float8_e4m3fn values with one float32 scale per stored token per kv head:
             value = fp8 * scale, scale = amax(|x|) / 448 over head_dim (448 is the
             largest finite e4m3 value), so every stored row uses the full fp8 range.

key/value may have another float dtype than a non-FP8 cache: they are cast to the cache
dtype (round to nearest even). The Triton version (kv_store_triton.store_kv_triton) has
the same signature and writes bit-identical caches (it rounds to e4m3 and bf16
explicitly, so the result does not depend on the conversion the backend provides).
Two tokens mapped to the same slot in one call is undefined (last writer wins on CPU).
"""

from __future__ import annotations

import torch

from ._validate import FLOAT_DTYPES, INDEX_DTYPES, check_kv_cache, check_tensor

FP8_MAX = 448.0
# Smallest amax used for a scale, so an all-zero row gets a finite scale (and stores zeros).
FP8_MIN_AMAX = 1e-12


def store_kv_reference(
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
    slots = slot_mapping.long()  # [num_tokens]
    if bool((slots < 0).any()):  # skip entries marked < 0
        valid = slots >= 0  # [num_tokens]
        slots, key, value = slots[valid], key[valid], value[valid]
    _, _, nkv, hd = k_cache.shape
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        flat = cache.view(-1, nkv, hd)  # [num_slots, num_kv_heads, head_dim]
        if is_fp8:
            assert scale is not None
            quant, row_scale = quantize_fp8(new)
            flat.view(torch.uint8).index_copy_(0, slots, quant.view(torch.uint8))  # no fp8 index_copy on CPU
            scale.view(-1, nkv).index_copy_(0, slots, row_scale)
        else:
            flat.index_copy_(0, slots, new.to(cache.dtype))  # round to nearest even


def quantize_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, num_kv_heads, head_dim] -> (fp8 [n, num_kv_heads, head_dim], scale [n, num_kv_heads] f32)."""
    x = rows.float()  # [n, num_kv_heads, head_dim]
    scale = x.abs().amax(dim=-1).clamp(min=FP8_MIN_AMAX) / FP8_MAX  # [n, num_kv_heads]
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def validate_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> tuple[int, bool]:
    """Shared argument checks (reference and Triton). Returns (num_tokens, is_fp8)."""
    _, _, nkv, hd, is_fp8 = check_kv_cache(k_cache, v_cache, k_scale, v_scale)
    device = k_cache.device
    doc = f"[num_tokens, num_kv_heads={nkv}, head_dim={hd}]"
    check_tensor("key", key, [None, nkv, hd], FLOAT_DTYPES, device, doc)
    num_tokens = key.shape[0]
    check_tensor("value", value, [num_tokens, nkv, hd], (key.dtype,), device, doc)
    check_tensor("slot_mapping", slot_mapping, [num_tokens], INDEX_DTYPES, device, f"[num_tokens={num_tokens}]")
    return num_tokens, is_fp8
