"""Decode rows' attention in C++ over the paged bf16 pool (kernels/cpu_decode_attention.cpp)
against the bf16 torch path it replaces (paged_attention_cpu.py) and float32 attention."""

from __future__ import annotations

import pytest
import torch

from services.target.kernels import cpu_linear, cpu_rowops
from services.target.kernels.paged_attention_cpu import paged_attention_cpu_planned, plan_cpu_attention

from .helpers import (SeqSpec, assert_no_further_from_float32, assert_within_bf16_rounding, plan_rows,
                      run_cpu_planned, chain_tree,
                      make_batch)
from .test_paged_attention_cpu import _eager_bf16, _poison_invisible_slots

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason=f"{cpu_linear.unavailable_reason()}")



# the default model's, tiny ones, Qwen2.5-0.5B's (GQA 7, D 64) and Qwen3-0.6B's (GQA 2, D 128)
@pytest.mark.parametrize("heads,head_dim", [((4, 1), 256), ((4, 2), 16), ((3, 3), 32), ((14, 2), 64), ((16, 8), 128)])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_rows_in_cpp_match_the_bf16_torch_path_and_leave_other_rows_alone(heads, head_dim, window,
                                                                                 monkeypatch):
    """Decode rows (lone and grouped), a draft tree's and a short chunk's masked rows over shuffled
    blocks, with NaN/inf in every slot no row may see: the eager bf16 attention within bf16
    rounding. The 40-row chunk is not theirs: it attends in the C++ chunk kernel where the CPU has
    AVX512-BF16, else in torch's bf16 matmuls around the C++ masked softmax (within bf16 rounding of
    the torch path either way). Both sides keep the bf16 torch path where bf16 matmuls are emulated
    too (there long plans attend in float32 instead: test_paged_attention_cpu.py)."""
    from services.target.kernels import paged_attention_cpu
    monkeypatch.setattr(paged_attention_cpu, "emulated_bf16_matmul", lambda: False)
    g = torch.Generator().manual_seed(head_dim + (window or 0))
    seqs = [SeqSpec(40, 1), SeqSpec(3, 1), SeqSpec(25, 1), SeqSpec(7, 4), SeqSpec(31, 1),
            SeqSpec(0, 1), SeqSpec(12, 3, chain_tree(3)), SeqSpec(200, 1), SeqSpec(5, 40)]
    batch = make_batch(seqs, heads[0], heads[1], head_dim, 4, torch.bfloat16, g, use_tree_mask=True)
    _poison_invisible_slots(batch, window)
    ours, plan = run_cpu_planned(batch, window, cpp_attention=True)
    before, _ = run_cpu_planned(batch, window, cpp_attention=False)
    covered = plan_rows(plan, plan.decode_rows.plans)
    decode = [p.q_start for p in plan if p.q_len == 1 and p.mask is None]
    trees = [r for r in covered if r not in decode]  # the 4-row chunk's and the 3-node tree's rows
    assert len(decode) >= 5 and len(trees) == 7 and not ours.isnan().any()
    rest = [r for r in range(ours.shape[0]) if r not in covered]  # the 40-row chunk
    assert len(rest) == 40
    eager = _eager_bf16(batch, 0.3, window)
    # ... around the C++ masked softmax (its exp a polynomial): within bf16 rounding of before
    torch.testing.assert_close(ours[rest].float(), before[rest].float(), atol=0.03, rtol=0.03)
    assert (ours[rest] == before[rest]).float().mean().item() > 0.9
    assert_within_bf16_rounding(ours, eager, covered, 0.9)
    assert_no_further_from_float32(ours, before, batch, 0.3, window, 1.5)


def test_a_decode_rows_output_does_not_depend_on_the_other_rows_of_the_step():
    g = torch.Generator().manual_seed(5)
    seqs = [SeqSpec(50, 1), SeqSpec(9, 1), SeqSpec(70, 1)]
    batch = make_batch(seqs, 4, 1, 64, 4, torch.bfloat16, g)
    together, _ = run_cpu_planned(batch, None, cpp_attention=True)
    plan = plan_cpu_attention(4, batch.block_tables, batch.context_lens, batch.query_start_loc,
                              batch.query_positions, None, None)
    for i, p in enumerate(plan):  # each row alone: its own plan of one
        one = type(plan)([p])
        one.groups, one.grouped = [], frozenset()
        alone = paged_attention_cpu_planned(batch.query, batch.k_cache, batch.v_cache, one, 0.3, cpp_attention=True)
        assert torch.equal(alone[p.q_start], together[p.q_start])


def test_a_masked_row_reads_only_what_it_sees_and_a_row_that_sees_nothing_is_zero():
    q = torch.ones(2, 2, 16, dtype=torch.bfloat16)
    k = torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16)
    v = torch.arange(8, dtype=torch.bfloat16).view(2, 4, 1, 1).expand(2, 4, 1, 16).contiguous()
    k[1], v[1] = float("inf"), float("nan")  # block 1: another request's stale KV
    out = torch.full_like(q, 7.0)
    tables = torch.tensor([[0, 1], [0, 1]])
    masks = torch.tensor([[True, False, True, False, False, False], [False] * 6])
    cpu_rowops.decode_attention(q, k, v, torch.tensor([0, 1]), tables, torch.tensor([0, 0]), torch.tensor([6, 6]),
                                masks, 0.5, out)
    assert torch.equal(out[0], torch.ones(2, 16))  # equal scores: the mean of values 0 and 2
    assert torch.equal(out[1], torch.zeros(2, 16))


def test_out_of_range_rows_and_blocks_are_refused_before_any_read():
    q = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    cache = torch.zeros(3, 4, 1, 16, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    ok = (torch.tensor([1]), torch.tensor([[0, 2]]), torch.tensor([0]), torch.tensor([8]), None)
    cpu_rowops.decode_attention(q, cache, cache, *ok, 0.5, out)
    for bad, match in [((torch.tensor([2]),) + ok[1:], "row 0 out of range"),
                       ((ok[0], torch.tensor([[0, 3]])) + ok[2:], "block id out of range"),
                       (ok[:3] + (torch.tensor([9]), None), "row 0 out of range"),
                       (ok[:4] + (torch.ones(1, 4, dtype=torch.bool),), "row 0 out of range"),  # mask too short
                       (ok[:4] + (torch.ones(1, 8),), "masks bool")]:
        with pytest.raises(RuntimeError, match=match):
            cpu_rowops.decode_attention(q, cache, cache, *bad, 0.5, out)


def _store_step(seqs, window, seed=11, heads=(4, 1), head_dim=64):
    """A step's batch, its new keys and values and their slots (two tokens not stored: slot -1)."""
    g = torch.Generator().manual_seed(seed)
    batch = make_batch(seqs, heads[0], heads[1], head_dim, 4, torch.bfloat16, g, use_tree_mask=True)
    T = batch.query.shape[0]
    key = torch.randn(T, heads[1], head_dim, generator=g).to(torch.bfloat16)
    value = torch.randn(T, heads[1], head_dim, generator=g).to(torch.bfloat16)
    plan = plan_cpu_attention(4, batch.block_tables, batch.context_lens, batch.query_start_loc,
                              batch.query_positions, window, batch.tree_mask)
    slots = torch.randperm(batch.k_cache.shape[0] * 4, generator=g)[:T]
    slots[0] = -1
    return batch, key, value, slots, plan


@pytest.mark.parametrize("window", [None, 5])
def test_store_and_attend_in_one_call_equals_store_kv_then_the_decode_kernel(window):
    """Decode rows and a 3-node tree: the fused call's pool and output equal store_kv_reference then
    paged_attention_cpu_planned's, bit for bit; a slot < 0 is not stored."""
    from services.target.kernels.kv_store import store_kv_reference
    from services.target.kernels.paged_attention_cpu import store_and_attend
    batch, key, value, slots, plan = _store_step(
        [SeqSpec(40, 1), SeqSpec(3, 1), SeqSpec(12, 3, chain_tree(3)), SeqSpec(25, 1)], window)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    fused = store_and_attend(batch.query, key, value, kc, vc, slots, plan, 0.3)
    rk, rv = batch.k_cache.clone(), batch.v_cache.clone()
    store_kv_reference(key, value, rk, rv, slots)
    reference = paged_attention_cpu_planned(batch.query, rk, rv, plan, 0.3, cpp_attention=True)
    assert plan.every_row_decode and torch.equal(kc, rk) and torch.equal(vc, rv)
    assert torch.equal(fused, reference)


def test_store_and_attend_declines_a_step_with_a_prefill_chunk_and_writes_nothing():
    from services.target.kernels.paged_attention_cpu import store_and_attend
    batch, key, value, slots, plan = _store_step([SeqSpec(7, 1), SeqSpec(5, 40)], None)
    kc = batch.k_cache.clone()
    assert store_and_attend(batch.query, key, value, kc, batch.v_cache, slots, plan, 0.3) is None
    assert not plan.every_row_decode and torch.equal(kc, batch.k_cache)
    assert store_and_attend(batch.query, key.float(), value, kc, batch.v_cache, slots, plan, 0.3) is None
    two, key, value, slots, plan = _store_step([SeqSpec(7, 1), SeqSpec(9, 1)], None)  # decode rows only
    assert store_and_attend(two.query, key, value, two.k_cache, two.v_cache, slots.int(), plan, 0.3) is None  # int32 slots


def test_store_and_attend_refuses_an_out_of_range_slot_before_writing():
    batch, key, value, slots, plan = _store_step([SeqSpec(9, 1), SeqSpec(20, 1)], None)
    from services.target.kernels.paged_attention_cpu import store_and_attend
    kc = batch.k_cache.clone()
    slots[1] = kc.shape[0] * kc.shape[1]  # one past the pool
    with pytest.raises(RuntimeError, match="slot .* out of range"):
        store_and_attend(batch.query, key, value, kc, batch.v_cache, slots, plan, 0.3)
    assert torch.equal(kc, batch.k_cache)
    with pytest.raises(RuntimeError, match="key and value"):
        store_and_attend(batch.query, key[:1], value, kc, batch.v_cache, slots, plan, 0.3)
