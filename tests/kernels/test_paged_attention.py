"""Paged attention: reference vs naive dense attention, Triton vs reference."""

from __future__ import annotations

import pytest
import torch

from services.target.kernels import paged_attention_reference

from .conftest import DEVICE
from .helpers import (
    ATTN_TOL,
    SeqSpec,
    binary_tree,
    chain_tree,
    make_batch,
    naive_attention,
    random_tree,
    unbalanced_tree,
    wide_tree,
)

TREE_SHAPES = {"chain": chain_tree, "wide": wide_tree, "binary": binary_tree, "unbalanced": unbalanced_tree}


def _pick(gen: torch.Generator, options: list):
    return options[int(torch.randint(0, len(options), (1,), generator=gen))]


def _rand(gen: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def random_case(seed: int, device: str = "cpu"):
    """A random mixed batch: decode steps, prefill chunks (with cached prefix), trees."""
    g = torch.Generator().manual_seed(seed)
    use_tree = seed % 2 == 1
    seqs = []
    for _ in range(_rand(g, 1, 4)):
        kind = _pick(g, ["decode", "prefill", "tree"] if use_tree else ["decode", "prefill"])
        if kind == "decode":
            seqs.append(SeqSpec(_rand(g, 0, 40), 1))
        elif kind == "prefill":
            seqs.append(SeqSpec(_rand(g, 0, 20), _rand(g, 1, 12)))
        else:
            n = _rand(g, 2, 9)
            parents = _pick(g, [chain_tree(n), wide_tree(n), binary_tree(n), unbalanced_tree(n), random_tree(n, g)])
            seqs.append(SeqSpec(_rand(g, 0, 20), n, parents))
    nkv, group = _pick(g, [1, 2]), _pick(g, [1, 2, 3, 4])
    batch = make_batch(
        seqs, num_heads=nkv * group, num_kv_heads=nkv, head_dim=_pick(g, [16, 32, 48, 64]),
        block_size=_pick(g, [1, 4, 8, 16, 32]), dtype=_pick(g, [torch.float32, torch.float32, torch.bfloat16, torch.float16]),
        gen=g, device=device, use_tree_mask=use_tree,
    )
    window = _pick(g, [None, None, _rand(g, 1, 12)])
    scale = batch.query.shape[-1] ** -0.5
    return batch, scale, window


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol, msg=what)


# ------------------------------------------------------------ reference vs naive dense

@pytest.mark.parametrize("seed", range(12))
def test_reference_matches_naive_dense(seed):
    batch, scale, window = random_case(seed)
    out = paged_attention_reference(**batch.args(scale, window))
    expected = naive_attention(batch, scale, window)
    # Both compute in f32 from the same stored values; the only rounding is the output cast.
    assert_close(out, expected.to(batch.query.dtype), batch.query.dtype, f"seed {seed}")


@pytest.mark.parametrize("shape", sorted(TREE_SHAPES))
@pytest.mark.parametrize("window", [None, 2])
def test_reference_tree_matches_naive_dense(shape, window):
    g = torch.Generator().manual_seed(7)
    seqs = [SeqSpec(5, 7, TREE_SHAPES[shape](7)), SeqSpec(3, 4), SeqSpec(9, 1)]  # tree + prefill + decode
    batch = make_batch(seqs, 4, 2, 16, 4, torch.float32, g, use_tree_mask=True)
    out = paged_attention_reference(**batch.args(0.3, window))
    torch.testing.assert_close(out, naive_attention(batch, 0.3, window), atol=1e-5, rtol=1e-5)


def test_reference_fp8_matches_naive_dense():
    g = torch.Generator().manual_seed(3)
    batch = make_batch([SeqSpec(6, 3), SeqSpec(0, 1)], 4, 2, 32, 4, torch.float32, g, fp8=True)
    out = paged_attention_reference(**batch.args(0.2))
    torch.testing.assert_close(out, naive_attention(batch, 0.2, None), atol=1e-5, rtol=1e-5)


def test_fully_masked_row_is_zero():
    # Window 1 with a tree whose node 1 is hidden from itself: impossible in practice; use
    # a tree mask with an all-False row to check the "no visible kv -> zeros" rule.
    g = torch.Generator().manual_seed(0)
    batch = make_batch([SeqSpec(0, 2, chain_tree(2))], 2, 1, 16, 4, torch.float32, g, use_tree_mask=True)
    batch.tree_mask[1] = False
    batch.tree_mask[0] = False
    out = paged_attention_reference(**batch.args(0.25))
    assert torch.equal(out, torch.zeros_like(out))


# ------------------------------------------------------------ Triton vs reference

@pytest.mark.triton
@pytest.mark.parametrize("seed", range(14))
def test_triton_matches_reference_random(triton_kernels, seed):
    batch, scale, window = random_case(100 + seed, DEVICE)
    expected = paged_attention_reference(**batch.args(scale, window))
    out = triton_kernels.paged_attention(**batch.args(scale, window))
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert_close(out, expected, batch.query.dtype, f"seed {100 + seed}")


@pytest.mark.triton
@pytest.mark.parametrize("shape", sorted(TREE_SHAPES))
def test_triton_tree_shapes(triton_kernels, shape):
    g = torch.Generator().manual_seed(11)
    seqs = [SeqSpec(13, 9, TREE_SHAPES[shape](9)), SeqSpec(0, 5), SeqSpec(21, 1), SeqSpec(2, 4, random_tree(4, g))]
    batch = make_batch(seqs, 6, 2, 32, 8, torch.float32, g, DEVICE, use_tree_mask=True)
    for window in (None, 4):
        expected = paged_attention_reference(**batch.args(0.2, window))
        assert_close(triton_kernels.paged_attention(**batch.args(0.2, window)), expected, torch.float32, shape)


@pytest.mark.triton
def test_triton_decode_batch_long_context(triton_kernels):
    # num_tokens == num_seqs selects the decode tile config; contexts span many kv tiles.
    g = torch.Generator().manual_seed(5)
    seqs = [SeqSpec(c, 1) for c in (0, 1, 63, 64, 150)]
    batch = make_batch(seqs, 8, 2, 32, 16, torch.bfloat16, g, DEVICE)
    for window in (None, 1, 40, 24):  # 150 - 24 + 1 = 127: first visible entry ends a kv tile
        expected = paged_attention_reference(**batch.args(0.17, window))
        assert_close(triton_kernels.paged_attention(**batch.args(0.17, window)), expected, torch.bfloat16, str(window))


@pytest.mark.triton
def test_triton_sliding_window_skips_tiles(triton_kernels):
    # Long cached prefix + prefill chunk: tiles wholly before the window are skipped.
    g = torch.Generator().manual_seed(6)
    batch = make_batch([SeqSpec(150, 20), SeqSpec(70, 3)], 4, 4, 16, 16, torch.float32, g, DEVICE)
    for window in (17, 24):  # 150 - 24 + 1 = 127: the first visible entry is the last of a tile
        expected = paged_attention_reference(**batch.args(0.25, window))
        assert_close(triton_kernels.paged_attention(**batch.args(0.25, window)), expected, torch.float32, str(window))


@pytest.mark.triton
def test_triton_head_dim_256_gemma_shape(triton_kernels):
    # Gemma 3: 4 query heads, 1 kv head, head_dim 256, sliding-window layers.
    g = torch.Generator().manual_seed(8)
    seqs = [SeqSpec(10, 3), SeqSpec(4, 1), SeqSpec(2, 4, binary_tree(4))]
    batch = make_batch(seqs, 4, 1, 256, 16, torch.bfloat16, g, DEVICE, use_tree_mask=True)
    for window in (None, 6):
        expected = paged_attention_reference(**batch.args(256**-0.5, window))
        assert_close(triton_kernels.paged_attention(**batch.args(256**-0.5, window)), expected, torch.bfloat16, "d=256")


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_cache(triton_kernels, dtype):
    # FP8 blocks written by store_kv, read back by both attentions.
    g = torch.Generator().manual_seed(9)
    batch = make_batch([SeqSpec(9, 4), SeqSpec(0, 1), SeqSpec(17, 2)], 4, 2, 32, 4, dtype, g, DEVICE, fp8=True)
    expected = paged_attention_reference(**batch.args(0.2, 8))
    assert_close(triton_kernels.paged_attention(**batch.args(0.2, 8)), expected, dtype, "fp8")


@pytest.mark.triton
def test_triton_empty_sequence_in_batch(triton_kernels):
    g = torch.Generator().manual_seed(10)
    batch = make_batch([SeqSpec(5, 2), SeqSpec(7, 0), SeqSpec(0, 3)], 2, 1, 16, 4, torch.float32, g, DEVICE)
    expected = paged_attention_reference(**batch.args(0.3))
    assert_close(triton_kernels.paged_attention(**batch.args(0.3)), expected, torch.float32, "empty seq")


@pytest.mark.triton
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_triton_cache_dtype_differs_from_query(triton_kernels, dtype, cache_dtype):
    g = torch.Generator().manual_seed(12)
    batch = make_batch([SeqSpec(9, 4), SeqSpec(3, 1)], 4, 2, 32, 8, dtype, g, DEVICE, cache_dtype=cache_dtype)
    expected = paged_attention_reference(**batch.args(0.2, 6))
    torch.testing.assert_close(expected.float().cpu(), naive_attention(batch, 0.2, 6), atol=2e-2, rtol=2e-2)
    assert_close(triton_kernels.paged_attention(**batch.args(0.2, 6)), expected, dtype, "mixed dtypes")
