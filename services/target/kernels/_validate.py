"""Argument checks shared by the reference and Triton kernel wrappers.

Every public kernel entry point validates its tensors here before doing any work, so
that a wrong shape, dtype, device or layout fails with a ValueError / TypeError naming
the argument and what was expected, instead of a crash (or silent garbage) in a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPE = torch.float8_e4m3fn
KV_CACHE_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
    shape_doc: str = "",
) -> torch.Tensor:
    """Check that `t` is a contiguous tensor of the given rank/shape/dtype/device.

    `shape` entries that are None are free (only the rank is checked for them).
    Raises TypeError for a non-tensor or wrong dtype, ValueError for shape, layout or
    device problems. Returns `t` so calls can be chained.
    """
    want = shape_doc or "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {want}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {want}); call .contiguous() first")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on device {device}, got {t.device}")
    return t


def check_kv_cache(
    k_cache: object,
    v_cache: object,
    k_scale: object,
    v_scale: object,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    device: torch.device | None = None,
) -> tuple[int, int, int, int, bool]:
    """Validate one layer's paged KV cache (and FP8 scales).

    Returns (num_blocks, block_size, num_kv_heads, head_dim, is_fp8).
    """
    doc = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_tensor("k_cache", k_cache, [None, None, num_kv_heads, head_dim], KV_CACHE_DTYPES, device, doc)
    assert isinstance(k_cache, torch.Tensor)
    num_blocks, block_size, nkv, hd = k_cache.shape
    check_tensor("v_cache", v_cache, list(k_cache.shape), (k_cache.dtype,), device, doc)
    is_fp8 = k_cache.dtype == FP8_DTYPE
    sdoc = "[num_blocks, block_size, num_kv_heads]"
    if is_fp8:
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale and v_scale are required when the KV cache is float8_e4m3fn")
        check_tensor("k_scale", k_scale, [num_blocks, block_size, nkv], (torch.float32,), device, sdoc)
        check_tensor("v_scale", v_scale, [num_blocks, block_size, nkv], (torch.float32,), device, sdoc)
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale/v_scale must be None unless the KV cache dtype is float8_e4m3fn")
    return num_blocks, block_size, nkv, hd, is_fp8
