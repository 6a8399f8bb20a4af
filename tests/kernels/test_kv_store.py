"""KV store: exact slot writes, skipped slots, FP8 quantization; Triton equals reference."""

from __future__ import annotations

import pytest
import torch

from services.target.kernels import store_kv_reference

from .conftest import DEVICE

FP8 = torch.float8_e4m3fn


def _case(seed: int, dtype: torch.dtype, fp8: bool, nkv: int, hd: int, device: str = "cpu", cache_dtype=None):
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_size, n = 7, 4, 11
    cache_dtype = FP8 if fp8 else (cache_dtype or dtype)
    caches = (torch.randn((2, num_blocks, block_size, nkv, hd), generator=g) * 2).to(cache_dtype)
    scales = torch.rand((2, num_blocks, block_size, nkv), generator=g) if fp8 else None
    key = (torch.randn((n, nkv, hd), generator=g) * torch.logspace(-3, 3, n)[:, None, None]).to(dtype)
    value = torch.randn((n, nkv, hd), generator=g).to(dtype)
    key[4] = 0.0  # an all-zero row: scale floor, zeros stored
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[[2, 7]] = -1  # skipped tokens
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    k_cache, v_cache = to(caches[0].clone()), to(caches[1].clone())
    k_scale, v_scale = (to(scales[0].clone()), to(scales[1].clone())) if fp8 else (None, None)
    return to(key), to(value), k_cache, v_cache, to(slots), k_scale, v_scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu() if t.dtype == FP8 else t.cpu()


def test_reference_writes_exact_slots_and_skips():
    key, value, k_cache, v_cache, slots, _, _ = _case(0, torch.float32, False, 2, 16)
    before_k = k_cache.clone()
    store_kv_reference(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], key[t]) and torch.equal(flat_v[s], value[t])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, 16)[untouched])


def test_reference_fp8_scale_and_error_bound():
    key, value, k_cache, v_cache, slots, k_scale, v_scale = _case(1, torch.float32, True, 2, 32)
    store_kv_reference(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    valid = slots >= 0
    s = slots[valid]
    deq = k_cache.view(-1, 2, 32)[s].float() * k_scale.view(-1, 2)[s][..., None]
    amax = key[valid].abs().amax(-1)
    torch.testing.assert_close(k_scale.view(-1, 2)[s], amax.clamp(min=1e-12) / 448.0)
    # e4m3: 3 mantissa bits -> relative rounding error <= 2**-4 in the normal range, and an
    # absolute error <= 2**-10 * scale in the subnormal range (|x / scale| < 2**-6).
    bound = key[valid].abs() * 2**-4 + k_scale.view(-1, 2)[s][..., None] * 2**-10
    assert ((deq - key[valid]).abs() <= bound + 1e-30).all()
    zero_row = slots[4]
    assert torch.equal(k_cache.view(-1, 2, 32)[zero_row].float(), torch.zeros(2, 32))


@pytest.mark.triton
@pytest.mark.parametrize(
    "dtype,fp8,nkv,hd",
    [
        (torch.float32, False, 2, 16),
        (torch.bfloat16, False, 3, 48),
        (torch.float16, False, 1, 64),
        (torch.float32, True, 2, 32),
        (torch.bfloat16, True, 1, 256),
        (torch.float16, True, 4, 24),
    ],
)
def test_triton_matches_reference_bitwise(triton_kernels, dtype, fp8, nkv, hd):
    ref = _case(2, dtype, fp8, nkv, hd)
    tri = _case(2, dtype, fp8, nkv, hd, DEVICE)
    store_kv_reference(*ref)
    triton_kernels.store_kv(*tri)
    for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), ref[2:], tri[2:]):
        if a is not None:
            assert torch.equal(_bits(a), _bits(b)), name


@pytest.mark.triton
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16), (torch.float32, torch.float16),
     (torch.bfloat16, torch.float32)],
)
def test_triton_casts_to_cache_dtype_like_reference(triton_kernels, dtype, cache_dtype):
    ref = _case(3, dtype, False, 2, 32, cache_dtype=cache_dtype)
    tri = _case(3, dtype, False, 2, 32, DEVICE, cache_dtype=cache_dtype)
    store_kv_reference(*ref)
    triton_kernels.store_kv(*tri)
    assert torch.equal(ref[2].cpu(), tri[2].cpu()) and torch.equal(ref[3].cpu(), tri[3].cpu())


@pytest.mark.triton
def test_triton_fp8_rounding_edge_values(triton_kernels):
    # Values that round up into the next binade, ties, subnormals and the 448 clamp.
    row = torch.tensor([448.0, 447.0, 31.6, -31.6, 15.5, 0.0137, -0.0009, 1e-6, 2.0**-7, 0.0])
    key = torch.zeros(1, 1, 16)
    key[0, 0, :10] = row
    slots = torch.tensor([1])
    outs = []
    for fn, dev in ((store_kv_reference, "cpu"), (triton_kernels.store_kv, DEVICE)):
        kc = torch.zeros((1, 2, 1, 16), dtype=FP8, device=dev)
        vc, ks, vs = kc.clone(), torch.zeros((1, 2, 1), device=dev), torch.zeros((1, 2, 1), device=dev)
        fn(key.to(dev), key.to(dev), kc, vc, slots.to(dev), ks, vs)
        outs.append((_bits(kc), ks.cpu()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.triton
def test_triton_empty_batch_is_noop(triton_kernels):
    k_cache = torch.randn(2, 4, 1, 16, device=DEVICE)
    before = k_cache.clone()
    empty = torch.empty(0, 1, 16, device=DEVICE)
    triton_kernels.store_kv(empty, empty, k_cache, k_cache.clone(), torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before)
