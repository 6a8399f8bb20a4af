"""Prefill chunks' attention in C++ with VDPBF16PS over the paged bf16 pool
(kernels/cpu_chunk_attention.cpp) against the eager bf16 attention, the bf16 torch path it
replaces (paged_attention_cpu.py) and float32 attention."""

from __future__ import annotations

import pytest
import torch

from services.target.kernels import cpu_kernels, cpu_linear, cpu_rowops, paged_attention_cpu
from services.target.kernels.paged_attention_cpu import paged_attention_cpu_planned, plan_cpu_attention

from .helpers import (SeqSpec, assert_no_further_from_float32, assert_within_bf16_rounding, plan_rows,
                      run_cpu_planned, make_batch,
                      random_tree)
from .test_paged_attention_cpu import _eager_bf16, _poison_invisible_slots

pytestmark = pytest.mark.skipif(not (cpu_linear.available() and cpu_linear.bf16_dot_instruction()),
                                reason="needs the AVX-512 kernel module and AVX512-BF16 (VDPBF16PS)")


def _amx_tiles_here() -> bool:
    return cpu_linear.available() and cpu_kernels.amx_cpu() and cpu_linear.amx()


@pytest.fixture(autouse=True, params=["vdpbf16ps", pytest.param("amx", marks=pytest.mark.skipif(
    not _amx_tiles_here(), reason="needs AMX-BF16 tiles (Intel Sapphire Rapids or later)"))])
def unit_path(request, monkeypatch):
    """Every test runs the kernel's VDPBF16PS units (what AVX512-BF16 CPUs without AMX run) and,
    where the CPU has AMX, its tile units (SPECMESH_AMX=0 keeps the former there)."""
    amx_cpu, amx = cpu_kernels.amx_cpu, cpu_linear.amx  # the cached functions themselves (a test may patch the names)
    monkeypatch.setenv("SPECMESH_AMX", "1" if request.param == "amx" else "0")
    amx_cpu.cache_clear()  # read once per process otherwise
    amx.cache_clear()
    assert amx() == (request.param == "amx")
    yield request.param
    amx_cpu.cache_clear()  # the environment is restored after this
    amx.cache_clear()


def test_with_amx_prefill_chunks_attend_in_the_kernel_and_window_chunks_whole(monkeypatch):
    """Where the CPU has AMX tiles the chunk kernel runs on them (it took prefill chunks from torch's
    oneDNN matmuls there), and a window layer's chunk attends whole."""
    monkeypatch.setattr(paged_attention_cpu.cpu_kernels, "amx_cpu", lambda: True)
    assert paged_attention_cpu.chunk_kernel_runs(torch.bfloat16, torch.bfloat16, 64, True)
    assert paged_attention_cpu.whole_windows(torch.bfloat16, torch.bfloat16, 64, True)
    assert not paged_attention_cpu.whole_windows(torch.float32, torch.float32, 64, False)


@pytest.mark.parametrize("heads,head_dim", [((4, 1), 256), ((4, 2), 64), ((3, 3), 128), ((8, 1), 64)])
@pytest.mark.parametrize("window", [None, 6, 40])
def test_chunks_in_cpp_match_eager_bf16_attention(heads, head_dim, window):
    """Causal chunks of 30 to 300 rows (cut into 64-row pieces in window layers), from an empty
    context and after one, over shuffled blocks, with inf/NaN in every slot no row may see: the
    eager bf16 attention within bf16 rounding, nearly all outputs equal; no further from float32
    than the torch bf16 path."""
    g = torch.Generator().manual_seed(head_dim + (window or 0))
    seqs = [SeqSpec(40, 1), SeqSpec(3, 30), SeqSpec(25, 1), SeqSpec(0, 50), SeqSpec(200, 1),
            SeqSpec(5, 40), SeqSpec(100, 300)]
    batch = make_batch(seqs, heads[0], heads[1], head_dim, 4, torch.bfloat16, g, use_tree_mask=False)
    _poison_invisible_slots(batch, window)
    ours, plan = run_cpu_planned(batch, window, cpp_attention=True)
    before, _ = run_cpu_planned(batch, window, cpp_attention=False)
    chunk_rows = plan_rows(plan, plan.chunk_pieces.plans)
    assert len(chunk_rows) == 30 + 50 + 40 + 300  # every chunk row, none of the decode rows
    assert not ours.isnan().any()
    assert_within_bf16_rounding(ours, _eager_bf16(batch, 0.3, window), chunk_rows, 0.99)
    assert_no_further_from_float32(ours, before, batch, 0.3, window, 1.1)


def test_a_window_layers_chunk_is_one_piece_for_the_chunk_kernel():
    """Uncut (cut_windows=False, as attention.py plans where this kernel runs), a 300-row chunk
    of a window layer is one piece and matches the eager bf16 attention as the cut pieces do."""
    g = torch.Generator().manual_seed(11)
    batch = make_batch([SeqSpec(100, 300), SeqSpec(7, 1)], 4, 1, 64, 4, torch.bfloat16, g)
    _poison_invisible_slots(batch, 40)
    args = (batch.k_cache.shape[1], batch.block_tables, batch.context_lens, batch.query_start_loc,
            batch.query_positions, 40, None)
    cut, whole = plan_cpu_attention(*args), plan_cpu_attention(*args, cut_windows=False)
    assert len(cut) == 6 and len(whole) == 2  # 5 pieces of <= 64 rows, or 1; + the decode row
    eager = _eager_bf16(batch, 0.3, 40)
    for plan in (cut, whole):
        out = paged_attention_cpu_planned(batch.query, batch.k_cache, batch.v_cache, plan, 0.3, cpp_attention=True)
        assert len(plan.chunk_pieces.plans) == len(plan) - 1
        assert_within_bf16_rounding(out, eager, list(range(out.shape[0])), 0.99)


def test_a_row_sees_only_its_run_and_a_row_that_sees_nothing_is_zero():
    """Row 0 sees entries 1..2, row 1 entries 0..4, row 2 nothing; entries 5..7 (in the piece's
    range, seen by no row) and entry 0's key hold inf/NaN: never read into a row that does not see them."""
    D = 64
    q = torch.zeros(3, 1, D, dtype=torch.bfloat16)
    k = torch.zeros(2, 4, 1, D, dtype=torch.bfloat16)
    v = torch.arange(8, dtype=torch.bfloat16).view(2, 4, 1, 1).expand(2, 4, 1, D).contiguous()
    k[1, 1:], v[1, 1:] = float("inf"), float("nan")  # entries 5..7 of the run 0 1 2 3 | 4 5 6 7
    v[0, 0] = 100.0  # entry 0: seen by row 1 only
    out = torch.full_like(q, 7.0)
    pieces = torch.tensor([[0, 3, 0, 8]])
    bounds = torch.tensor([[1, 3], [0, 5], [0, 0]])
    cpu_rowops.chunk_attention(q, k, v, pieces, torch.tensor([[0, 1]]), bounds, 0.5, out)
    assert torch.equal(out[0], torch.full((1, D), 1.5, dtype=torch.bfloat16))  # equal scores: mean of 1 and 2
    assert torch.equal(out[1], torch.full((1, D), 22.0, dtype=torch.bfloat16))  # (100 + 1 + 2 + 3 + 4) / 5
    assert torch.equal(out[2], torch.zeros(1, D, dtype=torch.bfloat16))


def test_a_pieces_output_does_not_depend_on_the_other_pieces_of_the_call():
    g = torch.Generator().manual_seed(3)
    batch = make_batch([SeqSpec(10, 40), SeqSpec(0, 70), SeqSpec(33, 20)], 4, 1, 64, 4, torch.bfloat16, g)
    together, plan = run_cpu_planned(batch, None, cpp_attention=True)
    for p in plan:
        one = type(plan)([p])
        one.groups, one.grouped = [], frozenset()
        alone = paged_attention_cpu_planned(batch.query, batch.k_cache, batch.v_cache, one, 0.3, cpp_attention=True)
        assert one.chunk_pieces is not None
        rows = slice(p.q_start, p.q_start + p.q_len)
        assert torch.equal(alone[rows], together[rows])


def test_a_large_tree_and_a_cpu_without_bf16_dot_keep_torchs_matmuls(monkeypatch):
    g = torch.Generator().manual_seed(9)
    tree = SeqSpec(30, 24, random_tree(24, g))  # 24 nodes: past the per-row kernel, not one run per row
    batch = make_batch([SeqSpec(12, 40), tree], 4, 1, 64, 4, torch.bfloat16, g, use_tree_mask=True)
    ours, plan = run_cpu_planned(batch, None, cpp_attention=True)
    tree_plan = next(i for i, p in enumerate(plan) if p.q_len == 24)
    assert tree_plan not in plan.chunk_pieces.plans and len(plan.chunk_pieces.plans) == 1
    eager = _eager_bf16(batch, 0.3, None)
    torch.testing.assert_close(ours.float(), eager.float(), atol=0.03, rtol=0.03)
    monkeypatch.setattr(paged_attention_cpu.cpu_linear, "bf16_dot_instruction", lambda: False)
    _, plan = run_cpu_planned(batch, None, cpp_attention=True)
    assert plan.chunk_pieces is None


def test_out_of_range_pieces_blocks_and_runs_are_refused_before_any_read():
    q = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, 4, 1, 64, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    pieces, tables, bounds = torch.tensor([[1, 2, 0, 8]]), torch.tensor([[0, 2]]), torch.tensor([[0, 7], [0, 8]])
    cpu_rowops.chunk_attention(q, cache, cache, pieces, tables, bounds, 0.5, out)
    for bad, match in [((torch.tensor([[3, 2, 0, 8]]), tables, bounds), "piece 0 out of range"),
                       ((torch.tensor([[1, 2, 0, 9]]), tables, bounds), "piece 0 out of range"),
                       ((pieces, torch.tensor([[0, 3]]), bounds), "block id out of range"),
                       ((pieces, tables, torch.tensor([[0, 7], [2, 9]])), "row 1 sees outside"),
                       ((pieces, tables, torch.tensor([[3, 2], [0, 8]])), "row 0 sees outside"),
                       ((pieces, tables, torch.tensor([[0, 7]])), "one row per query row")]:
        with pytest.raises(RuntimeError, match=match):
            cpu_rowops.chunk_attention(q, cache, cache, *bad, 0.5, out)
