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
    # bf16 queries over a float32 cache take the float32 path: the reference's own result.
    batch = make_batch([SeqSpec(9, 2), SeqSpec(17, 1)], 4, 1, 32, 8, torch.bfloat16, g,
                       cache_dtype=torch.float32)
    assert torch.equal(paged_attention_cpu(**batch.args(0.2)), paged_attention_reference(**batch.args(0.2)))
    # bf16 queries over a bf16 cache take the bf16 matmul path: within bf16's tolerance.
    batch = make_batch([SeqSpec(9, 2), SeqSpec(17, 1)], 4, 1, 32, 8, torch.bfloat16, g)
    assert_close(paged_attention_cpu(**batch.args(0.2)), paged_attention_reference(**batch.args(0.2)),
                 torch.bfloat16, "bf16 cache")


def _eager_bf16(batch, scale: float, window: int | None) -> torch.Tensor:
    """Eager bf16 attention on the naive dense layout, head by head: scaled bf16 scores (one
    rounding of a float32-accumulated dot), softmax normalised in float32, bf16 probabilities
    times bf16 values."""
    from .helpers import visible_mask
    out = []
    for s, spec in enumerate(batch.seqs):
        start = int(batch.query_start_loc[s])
        q = batch.query[start:start + spec.q_len].transpose(0, 1)  # [H, q, D] bf16
        k = batch.k_dense[s].transpose(0, 1).to(torch.bfloat16)  # [nkv, kv, D], exact: stored as bf16
        v = batch.v_dense[s].transpose(0, 1).to(torch.bfloat16)
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = torch.baddbmm(torch.zeros(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype), q,
                               k.transpose(1, 2), beta=0, alpha=scale)  # [H, q, kv] bf16
        mask = visible_mask(batch, s, window)  # [q, kv]
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        o = torch.matmul(probs, v).transpose(0, 1)  # [q, H, D]
        out.append(torch.where(mask.any(-1)[:, None, None], o, torch.zeros((), dtype=o.dtype)))
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 5])
def test_cpu_bf16_path_is_eager_bf16_attention(window):
    """The bf16 path computes what Hugging Face's eager bf16 attention computes (same roundings),
    for decode groups, prefill chunks and trees, with stale NaN in slots no row may see."""
    g = torch.Generator().manual_seed(41)
    seqs = [SeqSpec(30, 1), SeqSpec(21, 1), SeqSpec(6, 4), SeqSpec(3, 1), SeqSpec(12, 3, chain_tree(3)),
            SeqSpec(2, 1), SeqSpec(80, 1)]
    batch = make_batch(seqs, 4, 2, 16, 4, torch.bfloat16, g, use_tree_mask=True)
    plan = plan_cpu_attention(4, batch.block_tables, batch.context_lens, batch.query_start_loc,
                              batch.query_positions, window, batch.tree_mask)
    assert plan.groups, "decode rows of similar lengths form a group"
    _poison_invisible_slots(batch, window)
    out = paged_attention_cpu(**batch.args(0.3, window))
    assert not out.isnan().any()
    eager = _eager_bf16(batch, 0.3, window)
    lone = [r for i, p in enumerate(plan) if i not in plan.grouped and p.mask is None
            for r in range(p.q_start, p.q_start + p.q_len)]  # bf16 SDPA: float32 scores
    # The 81-entry decode row has no partner within 2x, except under the window (all 5 entries).
    assert lone == ([] if window else [int(batch.query_start_loc[-1]) - 1])
    rest = [r for r in range(out.shape[0]) if r not in lone]
    assert torch.equal(out[rest], eager[rest])  # bit for bit
    assert_close(out, naive_attention(batch, 0.3, window), torch.bfloat16, "against float32")


def _poison_invisible_slots(batch, window: int | None) -> None:
    """Slots no query row may read get inf (keys) and NaN (values): a freed block's stale KV."""
    from .helpers import visible_mask
    visible = torch.zeros(batch.k_cache.shape[0] * batch.k_cache.shape[1], dtype=torch.bool)
    bs = batch.k_cache.shape[1]
    for s, spec in enumerate(batch.seqs):
        seen = visible_mask(batch, s, window).any(0)  # [kv] entries some row of s sees
        for j in seen.nonzero().flatten().tolist():
            visible[int(batch.block_tables[s, j // bs]) * bs + j % bs] = True
    for cache, poison in ((batch.k_cache, float("inf")), (batch.v_cache, float("nan"))):
        cache.view(-1, *cache.shape[2:])[~visible] = poison


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
    _poison_invisible_slots(batch, 4)  # all but the window of 4 ending at each decode row
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


@pytest.mark.parametrize("native, kernels", [(True, True), (True, False), (False, True), (False, False)])
def test_auto_kv_dtype_is_bf16_for_bf16_models_where_bf16_attention_is_fast(tmp_path, monkeypatch, native, kernels):
    """A bf16 model's keys and values are bf16 already: where the CPU multiplies bf16 natively, or
    where specmesh's C++ kernels attend its decode rows in the pool (AVX2 CPUs too), the cache keeps
    them as they are (half the bytes of float32); elsewhere float32. Settings that keep attention
    out of C++ (torch's weight formats, the generic forward) keep float32 without native bf16."""
    from services.target.config import EngineConfig
    from services.target.kernels import cpu_linear
    from services.target.model import linear
    monkeypatch.setattr(linear, "native_bf16_cpu", lambda: native)
    monkeypatch.setattr(cpu_linear, "available", lambda: kernels)
    bf16_pool = torch.bfloat16 if native or kernels else torch.float32
    assert EngineConfig(model_dir=tmp_path, dtype="bfloat16").torch_kv_dtype == bf16_pool
    assert EngineConfig(model_dir=tmp_path, dtype="bfloat16", weights="bf16-avx512").torch_kv_dtype == bf16_pool
    torch_attention = torch.bfloat16 if native else torch.float32
    assert EngineConfig(model_dir=tmp_path, dtype="bfloat16", weights="fp16").torch_kv_dtype == torch_attention
    assert EngineConfig(model_dir=tmp_path, dtype="bfloat16", forward="generic").torch_kv_dtype == torch_attention
    assert EngineConfig(model_dir=tmp_path, dtype="float16").torch_kv_dtype == torch.float32
    assert EngineConfig(model_dir=tmp_path, dtype="float32").torch_kv_dtype == torch.float32
    assert EngineConfig(model_dir=tmp_path, dtype="bfloat16", kv_dtype="float32").torch_kv_dtype == torch.float32


def test_bf16_matmuls_go_through_float32_where_the_cpu_only_emulates_bf16(monkeypatch):
    """On an x86 CPU without AVX512-BF16 or AMX torch's bf16 matmuls are emulated (3x slower than
    float32 for a prefill chunk's attention): the torch path multiplies float32 copies of the bf16
    operands (the same exact products, float32 sums, one rounding to bf16), where bf16 is native
    it keeps bf16. Both routes give the bf16 attention within one rounding of each other. (Plans of
    FLOAT32_ROUTE_ROWS rows or more go further there: the float32 path, next test.)"""
    from services.target.kernels import cpu_kernels, paged_attention_cpu as module

    for flags, emulated in ((frozenset({"avx2", "fma", "f16c", "avx512f"}), True),
                            (frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16"}), False),
                            (frozenset({"avx2", "fma", "f16c", "amx_bf16"}), False)):
        module.emulated_bf16_matmul.cache_clear()
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
        assert module.emulated_bf16_matmul() is emulated
    module.emulated_bf16_matmul.cache_clear()
    monkeypatch.undo()
    g = torch.Generator().manual_seed(7)
    batch = make_batch([SeqSpec(64, 48), SeqSpec(30, 1), SeqSpec(9, 9)], 4, 2, 16, 8, torch.bfloat16, g)
    outs, routed = [], []
    bmm = torch.bmm

    def counting_bmm(a, b, **kw):
        routed.append(a.dtype == torch.float32 and a.shape[1] >= module.FLOAT32_ROUTE_ROWS)
        return bmm(a, b, **kw)
    monkeypatch.setattr(module.torch, "bmm", counting_bmm)
    for emulated in (True, False):
        monkeypatch.setattr(module, "emulated_bf16_matmul", lambda emulated=emulated: emulated)
        routed.clear()
        outs.append(paged_attention_cpu(**batch.args(0.25, None)))
        assert any(routed) is emulated  # the 48-row chunk's scores went through float32 only then
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert_close(outs[0], outs[1], torch.bfloat16, "float32 route against bf16 matmuls")


def test_long_plans_over_a_bf16_pool_attend_as_over_a_float32_pool_where_bf16_is_emulated(monkeypatch):
    """Where torch's bf16 matmuls are emulated (AVX2 CPUs, whose bf16 models keep a bf16 pool where
    the C++ kernels attend decode rows), prefill chunks and large trees attend in float32 over the
    widened pool: bit for bit what a float32 pool of the same (bf16) values gives. Shorter plans
    keep the bf16 path's precision (scores and probabilities rounded to bf16)."""
    from services.target.kernels import paged_attention_cpu as module
    g = torch.Generator().manual_seed(11)
    batch = make_batch([SeqSpec(64, 48), SeqSpec(30, 1), SeqSpec(40, 20), SeqSpec(9, 9)], 4, 2, 16, 8,
                       torch.bfloat16, g)
    args = batch.args(0.25, None)
    float_pool = {**args, "k_cache": args["k_cache"].float(), "v_cache": args["v_cache"].float()}
    monkeypatch.setattr(module, "emulated_bf16_matmul", lambda: True)
    got = paged_attention_cpu(**args)
    expected = paged_attention_cpu(**float_pool)
    assert got.dtype == expected.dtype == torch.bfloat16
    starts = batch.query_start_loc.tolist()
    long_rows = [r for s, e in zip(starts, starts[1:]) if e - s >= module.FLOAT32_ROUTE_ROWS for r in range(s, e)]
    assert len(long_rows) == 68  # the 48- and 20-row chunks
    assert torch.equal(got[long_rows], expected[long_rows])
    monkeypatch.setattr(module, "emulated_bf16_matmul", lambda: False)
    native = paged_attention_cpu(**args)  # bf16 matmuls: not the float32 pool's bits
    assert not torch.equal(native[long_rows], expected[long_rows])
