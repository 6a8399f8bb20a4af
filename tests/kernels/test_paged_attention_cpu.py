"""The CPU paged attention (per-sequence blocks read in place) equals the reference."""

from __future__ import annotations

import pytest
import torch

from services.target.kernels import paged_attention_reference
from services.target.kernels.paged_attention_cpu import paged_attention_cpu, plan_cpu_attention

from .helpers import SeqSpec, chain_tree, make_batch, naive_attention
from .test_paged_attention import TREE_SHAPES, assert_close, random_case


@pytest.mark.parametrize("seed", range(16))
def test_cpu_matches_reference_random(seed):
    """Random block tables, mixed decode / prefill / tree rows, head counts, dtypes, windows."""
    batch, scale, window = random_case(300 + seed)
    expected = paged_attention_reference(**batch.args(scale, window))
    assert_close(paged_attention_cpu(**batch.args(scale, window)), expected, batch.query.dtype, f"seed {seed}")


@pytest.mark.parametrize("shape", sorted(TREE_SHAPES))
@pytest.mark.parametrize("window", [None, 2, 5])
def test_cpu_tree_matches_naive_dense(shape, window):
    g = torch.Generator().manual_seed(11)
    seqs = [SeqSpec(5, 7, TREE_SHAPES[shape](7)), SeqSpec(3, 4), SeqSpec(9, 1)]  # tree + prefill + decode
    batch = make_batch(seqs, 4, 2, 16, 4, torch.float32, g, use_tree_mask=True)
    out = paged_attention_cpu(**batch.args(0.3, window))
    torch.testing.assert_close(out, naive_attention(batch, 0.3, window), atol=1e-5, rtol=1e-5)


def test_cpu_contiguous_blocks_are_views_and_match():
    """Blocks laid out consecutively are read as a view (no gather) with the same result."""
    g = torch.Generator().manual_seed(5)
    batch = make_batch([SeqSpec(37, 1), SeqSpec(20, 6), SeqSpec(0, 3)], 4, 1, 32, 4, torch.float32, g)
    # Relocate every sequence's blocks to consecutive ids (order of first use).
    need = [(s.context_len + s.q_len + 3) // 4 for s in batch.seqs]
    old = [batch.block_tables[s, :n].tolist() for s, n in enumerate(need)]
    flat = [b for ids in old for b in ids]
    batch.k_cache = batch.k_cache[torch.tensor(flat)].contiguous()
    batch.v_cache = batch.v_cache[torch.tensor(flat)].contiguous()
    table = torch.zeros_like(batch.block_tables)
    start = 0
    for s, n in enumerate(need):
        table[s, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    batch.block_tables = table
    plan = plan_cpu_attention(4, table, batch.context_lens, batch.query_start_loc, batch.query_positions)
    assert [p.blocks is None for p in plan] == [True, True, True]
    assert [(p.first_block, p.num_blocks, p.kv_offset, p.kv_len) for p in plan] == [
        (0, 10, 0, 38), (10, 7, 0, 26), (17, 1, 0, 3)]
    assert plan[0].mask is None and plan[1].mask.shape == (6, 26)
    out = paged_attention_cpu(**batch.args(0.25))
    torch.testing.assert_close(out, naive_attention(batch, 0.25, None), atol=1e-5, rtol=1e-5)


def test_cpu_sliding_window_reads_only_blocks_in_the_window():
    g = torch.Generator().manual_seed(2)
    batch = make_batch([SeqSpec(40, 1), SeqSpec(30, 5)], 2, 1, 16, 4, torch.float32, g)
    plan = plan_cpu_attention(4, batch.block_tables, batch.context_lens, batch.query_start_loc,
                              batch.query_positions, sliding_window=8)
    # Decode at position 40 sees positions 33..40: blocks 8..10, offset 1 within them, no mask.
    assert (plan[0].num_blocks, plan[0].kv_offset, plan[0].kv_len, plan[0].mask) == (3, 1, 8, None)
    # Chunk at positions 30..34 sees 23..34: blocks 5..8, offset 3.
    assert (plan[1].num_blocks, plan[1].kv_offset, plan[1].kv_len) == (4, 3, 12)
    out = paged_attention_cpu(**batch.args(0.5, 8))
    torch.testing.assert_close(out, naive_attention(batch, 0.5, 8), atol=1e-5, rtol=1e-5)


def test_cpu_fp8_and_bf16_caches():
    g = torch.Generator().manual_seed(3)
    batch = make_batch([SeqSpec(6, 3), SeqSpec(0, 1)], 4, 2, 32, 4, torch.float32, g, fp8=True)
    torch.testing.assert_close(paged_attention_cpu(**batch.args(0.2)), naive_attention(batch, 0.2, None),
                               atol=1e-5, rtol=1e-5)
    batch = make_batch([SeqSpec(9, 2), SeqSpec(17, 1)], 4, 1, 32, 8, torch.bfloat16, g)
    expected = paged_attention_reference(**batch.args(0.2))
    assert torch.equal(paged_attention_cpu(**batch.args(0.2)), expected)


def test_cpu_fully_masked_row_is_zero():
    g = torch.Generator().manual_seed(0)
    batch = make_batch([SeqSpec(0, 2, chain_tree(2))], 2, 1, 16, 4, torch.float32, g, use_tree_mask=True)
    batch.tree_mask[:] = False
    out = paged_attention_cpu(**batch.args(0.25))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("heads", [(4, 1), (8, 2), (3, 3)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("cache", ["f32", "bf16", "fp8"])
def test_cpu_decode_rows_are_grouped_by_length_and_match(heads, window, cache):
    """Decode rows of several sequences run as grouped calls (lengths within 2x, padded and
    masked) and equal the per-row naive attention; prefill and tree rows keep their own calls."""
    g = torch.Generator().manual_seed(sum(heads) + (window or 0))
    seqs = [SeqSpec(40, 1), SeqSpec(3, 1), SeqSpec(25, 1), SeqSpec(7, 4), SeqSpec(31, 1),
            SeqSpec(5, 1), SeqSpec(0, 1), SeqSpec(12, 3, chain_tree(3)), SeqSpec(22, 1)]
    kwargs = {"fp8": True} if cache == "fp8" else {
        "cache_dtype": torch.bfloat16 if cache == "bf16" else torch.float32}
    batch = make_batch(seqs, heads[0], heads[1], 16, 4, torch.float32, g, use_tree_mask=True, **kwargs)
    plan = plan_cpu_attention(4, batch.block_tables, batch.context_lens, batch.query_start_loc,
                              batch.query_positions, window, batch.tree_mask)
    grouped = sorted(sorted(batch.seqs[i].context_len for i in grp.members) for grp in plan.groups)
    if window is None:  # kv lengths 41, 32, 26, 23 | 6, 4 | 1 (alone: no group of one)
        assert grouped == [[3, 5], [22, 25, 31, 40]]
    else:  # the window caps every decode row at 6 entries: one group of all but the empty context
        assert grouped == [[3, 5, 22, 25, 31, 40]]
    assert len(plan) == len(seqs) and plan.grouped == {i for grp in plan.groups for i in grp.members}
    out = paged_attention_cpu(**batch.args(0.3, window))
    torch.testing.assert_close(out, naive_attention(batch, 0.3, window), atol=1e-5, rtol=1e-5)


def test_cpu_grouped_decode_never_reads_what_a_row_may_not_see():
    """Slots a grouped row gathers only as padding (the tail of its last block, entries before
    its window, other sequences' padding blocks) may hold anything, NaN and inf included: a
    freed block keeps the KV of the request that used it. Outputs stay those of naive attention."""
    g = torch.Generator().manual_seed(21)
    batch = make_batch([SeqSpec(9, 1), SeqSpec(13, 1), SeqSpec(6, 1)], 4, 1, 16, 4, torch.float32, g)
    expected = naive_attention(batch, 0.3, 4)
    plan = plan_cpu_attention(4, batch.block_tables, batch.context_lens, batch.query_start_loc,
                              batch.query_positions, 4)
    assert len(plan.groups) == 1 and len(plan.groups[0].members) == 3
    visible = torch.zeros(batch.k_cache.shape[0] * 4, dtype=torch.bool)  # [num_slots]
    for s, spec in enumerate(batch.seqs):
        total = spec.context_len + spec.q_len
        for j in range(max(0, total - 4), total):  # the window of 4 ending at the decode row
            visible[int(batch.block_tables[s, j // 4]) * 4 + j % 4] = True
    for cache, poison in ((batch.k_cache, float("inf")), (batch.v_cache, float("nan"))):
        cache.view(-1, *cache.shape[2:])[~visible] = poison
    out = paged_attention_cpu(**batch.args(0.3, 4))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_tree", [False, True])
def test_cpu_long_chunk_in_a_window_layer_is_cut_into_pieces_that_read_only_their_window(with_tree):
    from services.target.kernels.paged_attention_cpu import WINDOW_SUBCHUNK
    g = torch.Generator().manual_seed(31 + with_tree)
    seqs = [SeqSpec(100, 300), SeqSpec(7, 1)] + ([SeqSpec(12, 5, chain_tree(5))] if with_tree else [])
    batch = make_batch(seqs, 4, 2, 8, 4, torch.float32, g, use_tree_mask=with_tree)
    window = 40
    plan = plan_cpu_attention(4, batch.block_tables, batch.context_lens, batch.query_start_loc,
                              batch.query_positions, window, batch.tree_mask)
    pieces = [p for p in plan if p.q_start < 300]
    assert [p.q_len for p in pieces] == [64, 64, 64, 64, 44]
    assert all(p.kv_len <= WINDOW_SUBCHUNK + window - 1 for p in pieces)
    assert len(plan) == len(pieces) + len(seqs) - 1  # the decode row and the tree stay whole
    out = paged_attention_cpu(**batch.args(0.3, window))
    torch.testing.assert_close(out, naive_attention(batch, 0.3, window), atol=1e-5, rtol=1e-5)
    # Global layers (no window) keep the chunk whole.
    whole = plan_cpu_attention(4, batch.block_tables, batch.context_lens, batch.query_start_loc,
                               batch.query_positions, None, batch.tree_mask)
    assert whole[0].q_len == 300
    torch.testing.assert_close(paged_attention_cpu(**batch.args(0.3)), naive_attention(batch, 0.3, None),
                               atol=1e-5, rtol=1e-5)
