"""The argmax screen of greedy rows (services/target/kernels/argmax_screen.py, cpu_argmax_screen.cpp,
services/target/model/output_layer.py, services/target/engine/argmax_rows.py).

- The kernel's bounds hold: every exact logit (the bf16 kernel's) lies at or below its upper
  bound, the best lower bound at or below the row's largest logit, on weights and rows built to
  be hard (outlier components, zero rows, tiny and huge scales, a vocabulary not a multiple of 16).
- The screened row's argmax is the whole row's, ties included (the first index wins), and its
  finite entries are the whole row's bit for bit.
- In a forward and through the mesh: rows marked ARGMAX_ONLY take the screen, their argmax is the
  whole row's; greedy output is token-identical with the screen on and off, and rows that ask
  for log-probabilities never take it. A greedy draft tree's verify rows take it too, and the
  output stays the target's alone. Rows under min_tokens take it with end-of-sequence banned: a
  row whose screened argmax is a banned token is computed whole.
"""

from __future__ import annotations

import pytest
import torch

from services.target.kernels import argmax_screen, cpu_gguf_linear, cpu_linear
from services.target.engine.block_manager import BlockManager, PrefixMatch
from services.target.model.model_runner_inputs import StepInput
from services.target.model.output_layer import ARGMAX_ONLY, ArgmaxOnly, screen_max_rows
from tests.mesh import collect, request, start_draft, start_mesh
from tests.target.test_gguf_weights import gguf_gemma_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(argmax_screen.unavailable_reason(32) is not None,
                                reason=f"the argmax screen does not run here: {argmax_screen.unavailable_reason(32)}")

EMPTY = PrefixMatch((), (), 0)


def _hard_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k] bf16 with the cases that stretch a bound: rows at scales 1e-6 .. 1e3, an all-zero
    row, a row with one huge weight among tiny ones, and exact duplicates (tied logits)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-6, 3, n)[torch.randperm(n, generator=gen)][:, None]
    w[3] = 0.0
    w[7] = 1e-4
    w[7, 5] = 50.0
    w[11] = w[9]
    w[n - 1] = w[9]  # a tie at the far end: the first index must win
    return w.to(torch.bfloat16)


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    """[m, k] bf16 rows: normal, with an outlier component, tiny, and one all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, 1] = 400.0
    if m > 1:
        x[1] *= 1e-5
    if m > 2:
        x[2] = 0.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(1000, 64), (1037, 96), (4099, 32)])
def test_the_bounds_hold_and_the_screened_argmax_is_the_whole_rows(n, k):
    w = _hard_weights(n, k, seed=n)
    screen = argmax_screen.ArgmaxScreen(lambda ids: w[ids], n, k)
    panels = cpu_linear.pack(w)
    for m in (1, 2, 3, 5, 7):
        x = _rows(m, k, seed=m)
        whole = cpu_linear.bf16_linear(x, panels, n).float()  # [m, n]: the layer's own logits
        upper, best, union = argmax_screen.bounds(x, screen.weights)
        assert (upper >= whole).all()
        assert (best <= whole.amax(dim=1)).all()
        assert torch.equal(union, torch.unique(union))  # ascending, each once
        got = screen(x)
        if m >= 3:  # row 2 is all zero: every logit 0, every token ties, and the screen leaves it whole
            assert got is None and union.numel() == n
            got = screen(x[:2])
            whole = whole[:2]
        assert torch.equal(got.argmax(dim=1), whole.argmax(dim=1))
        finite = torch.isfinite(got)
        assert torch.equal(got[finite], whole[finite])
        assert finite.sum(dim=1).max() < n  # it screened something out


@pytest.mark.parametrize("k", [64, 96])
def test_the_amx_pass_returns_the_loops_bits_and_only_the_columns_that_reach_the_threshold(k):
    """Blocks of 64 k where the hidden size allows (96: blocks of 32). Where the CPU has AMX-INT8 the
    int8 pass runs on tiles from AMX_MIN_ROWS rows, and returns the VPDPBUSD loop's bits at every
    row count (whole tiles of 16 and the 1-8 row tails); elsewhere it never takes them. Either way
    the tokens returned are exactly those whose upper bound reaches some row's threshold (the
    kernel scans only the groups whose largest upper bound does)."""
    n = 4099
    w = _hard_weights(n, k, seed=k)
    screen = argmax_screen.ArgmaxScreen(lambda ids: w[ids], n, k)
    assert screen.weights.block == (64 if k % 64 == 0 else 32)
    for m in (1, 2, 3, 8, 9, 16, 17, 18, 33):
        x = _rows(m, k, seed=100 + m)[:, torch.randperm(k, generator=torch.Generator().manual_seed(m))]
        x[2 % m] = (torch.randn(k, generator=torch.Generator().manual_seed(m)) * 2).to(torch.bfloat16)
        loop = argmax_screen.bounds(x, screen.weights, amx=False)
        upper, best, union = loop
        threshold = best - torch.tensor(2.0 ** -6) * torch.maximum(best.abs(), upper.amax(dim=1).abs()) - 1e-30
        expected = (upper >= threshold[:, None]).any(dim=0).nonzero().flatten()
        assert torch.equal(union, expected)
        if argmax_screen.amx_int8():
            assert argmax_screen.takes_amx(m) == (m >= argmax_screen.AMX_MIN_ROWS)
            tiles = argmax_screen.bounds(x, screen.weights, amx=True)
            assert all(torch.equal(a, b) for a, b in zip(tiles, loop)), m
        else:
            assert not argmax_screen.takes_amx(m)


def test_a_tie_goes_to_the_first_index_as_in_the_whole_row():
    n, k = 512, 64
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.01).to(torch.bfloat16)
    x = torch.ones(1, k, dtype=torch.bfloat16)
    w[200] = 1.0  # the largest logit, three times: 200 wins
    w[201] = 1.0
    w[450] = 1.0
    screen = argmax_screen.ArgmaxScreen(lambda ids: w[ids], n, k)
    got = screen(x)
    assert got.argmax(dim=1).item() == 200
    assert {201, 450} <= set(torch.isfinite(got[0]).nonzero().flatten().tolist())


def test_the_screen_is_off_where_asked(monkeypatch):
    monkeypatch.setenv("SPECMESH_ARGMAX_SCREEN", "0")
    assert argmax_screen.unavailable_reason(64) == "SPECMESH_ARGMAX_SCREEN=0"
    monkeypatch.delenv("SPECMESH_ARGMAX_SCREEN")
    assert "multiple of 32" in argmax_screen.unavailable_reason(48)


def test_the_screen_keeps_no_autograd_graph_of_the_weights_it_reads(tiny_gemma_dir):
    """A screen built from a parameter that requires grad (as any nn.Module's does) once kept every
    chunk's autograd graph: ~8 GB resident in each target process of the default model."""
    weight = torch.nn.Parameter(_hard_weights(300, 64, 3))
    screen = argmax_screen.ArgmaxScreen(lambda ids: weight.index_select(0, ids), 300, 64)
    parts = screen.weights
    for t in (parts.quants, parts.scales, parts.weight_err, parts.weight_norm):
        assert not t.requires_grad and t.grad_fn is None
    # And a served model's parameters are frozen when it loads, so nothing derived from them does.
    runner = _runner(tiny_gemma_dir, "bf16-avx512")
    assert runner.lean_forward.output.screen.weights.weight_err.grad_fn is None
    assert not any(p.requires_grad for p in runner.model.parameters())


def _runner(model_dir, weights):
    from tests.target.test_gemma3_forward import _runner as format_runner
    runner = format_runner(model_dir, torch.bfloat16, weights)
    runner.blocks = BlockManager(128, 4)
    return runner


def _decode_rows(runner, subsets, n=6):
    """n sequences' prefills, then one decode row each: [n, vocab]."""
    for i in range(n):
        runner.blocks.admit(f"s{i}", EMPTY, 24, 9)
        runner.forward([StepInput.chunk(f"s{i}", list(range(5 + i, 13 + i)), 0, True)])
    return runner.forward([StepInput.chunk(f"s{i}", [40 + 7 * i], 8, True) for i in range(n)],
                          vocab_subsets=subsets)


def _weights():
    return ["bf16-avx512"] + (["gguf"] if cpu_gguf_linear.available() else [])


@pytest.mark.parametrize("weights", _weights())
def test_rows_marked_argmax_only_take_the_screen_in_a_forward(tiny_gemma_dir, gguf_gemma_dir, weights):
    model_dir = gguf_gemma_dir if weights == "gguf" else tiny_gemma_dir
    whole = _decode_rows(_runner(model_dir, weights), None)
    runner = _runner(model_dir, weights)
    assert runner.takes_argmax_rows
    marked = {0: ARGMAX_ONLY, 2: ARGMAX_ONLY, 5: ARGMAX_ONLY}
    got = _decode_rows(runner, marked)
    screen = runner.lean_forward.output.screen
    assert screen.rows == 3
    assert torch.equal(got.argmax(dim=1), whole.argmax(dim=1))
    for row in (1, 3, 4):  # unmarked rows stay whole
        assert torch.equal(got[row], whole[row])
    for row in marked:
        finite = torch.isfinite(got[row])
        assert finite.sum() < got.shape[1] and torch.equal(got[row][finite], whole[row][finite])
    # A row whose logits all tie (an all-zero input): the screen leaves it to the whole layer.
    output = runner.lean_forward.output
    h = torch.zeros(2, output.lm_head.in_features, dtype=torch.bfloat16)
    h[1] = 1.0
    assert torch.equal(output(h, {0: ARGMAX_ONLY}), output(h)) and output.screen.rows == 3
    # As many marked rows as the screen takes in one step (12 where its int8 pass runs on AMX-INT8
    # tiles, 18 on the AVX2 build, else 8), then one more: all of them whole.
    n = screen_max_rows() + 1
    whole = _decode_rows(_runner(model_dir, weights), None, n)
    runner = _runner(model_dir, weights)
    most = _decode_rows(runner, {r: ARGMAX_ONLY for r in range(n - 1)}, n)
    assert runner.lean_forward.output.screen.rows == n - 1
    assert torch.equal(most.argmax(dim=1), whole.argmax(dim=1)) and torch.equal(most[n - 1], whole[n - 1])
    runner = _runner(model_dir, weights)
    many = _decode_rows(runner, {r: ARGMAX_ONLY for r in range(n)}, n)
    assert runner.lean_forward.output.screen.rows == 0 and torch.equal(many, whole)


PROMPTS = ("the cat sat on the mat. the cat", "one two three", "a b a b a b")


@pytest.mark.parametrize("weights", _weights())
def test_a_row_whose_screened_argmax_is_banned_is_computed_whole(tiny_gemma_dir, gguf_gemma_dir, weights):
    model_dir = gguf_gemma_dir if weights == "gguf" else tiny_gemma_dir
    whole = _decode_rows(_runner(model_dir, weights), None)
    winners = whole.argmax(dim=1).tolist()
    runner = _runner(model_dir, weights)
    marked = {0: ArgmaxOnly((winners[0],)), 2: ArgmaxOnly((winners[2] + 1, 0)), 3: ARGMAX_ONLY}
    got = _decode_rows(runner, marked)
    assert runner.lean_forward.output.screen.rows == 3  # all three went through the screen
    assert torch.equal(got[0], whole[0])  # its argmax is banned: the whole row, for the mask to act on
    for row in (2, 3):  # the argmax is not banned: screened rows, the same argmax
        finite = torch.isfinite(got[row])
        assert finite.sum() < got.shape[1] and torch.equal(got[row][finite], whole[row][finite])
        assert int(got[row].argmax()) == winners[row]


async def _greedy(model_dir, logprobs=False, speculation=None, min_tokens=0):
    draft = await start_draft() if speculation else None  # prompt lookup runs in the draft service
    mesh = await start_mesh(model_dir, speculation, dtype="bfloat16", weights="bf16-avx512",
                            draft_address=draft.address if draft else "")
    try:
        outs = [await collect(mesh.router_stub, request(p, 24, logprobs=logprobs, min_tokens=min_tokens))
                for p in PROMPTS]
        screen = mesh.engine.runner.lean_forward.output.screen
        if speculation:
            assert sum(o[2].usage.proposed_tokens for o in outs) > 0, "no draft was verified"
        return [o[0] for o in outs], None if screen is None else screen.rows
    finally:
        await mesh.stop()
        if draft:
            await draft.stop(grace=0.5)


async def test_greedy_output_is_identical_with_the_screen_on_and_off(tiny_gemma_dir, monkeypatch):
    on, on_rows = await _greedy(tiny_gemma_dir)
    monkeypatch.setenv("SPECMESH_ARGMAX_SCREEN", "0")
    off, off_rows = await _greedy(tiny_gemma_dir)
    assert on_rows and on_rows > 0 and off_rows is None
    assert on == off


async def test_rows_that_ask_for_logprobs_never_take_the_screen(tiny_gemma_dir):
    _, rows = await _greedy(tiny_gemma_dir, logprobs=True)
    assert rows == 0


async def test_a_greedy_draft_trees_verify_rows_take_the_screen(tiny_gemma_dir, monkeypatch):
    """One request at a time, so a plain decode step screens one row: a call of 2+ rows is a verify
    pass (root + draft nodes). The answers equal speculation off, screen included."""
    calls = []
    screen_call = argmax_screen.ArgmaxScreen.__call__

    def counted(self, h):
        calls.append(h.shape[0])
        return screen_call(self, h)

    monkeypatch.setattr(argmax_screen.ArgmaxScreen, "__call__", counted)
    lookup, _ = await _greedy(tiny_gemma_dir, speculation={"speculation_method": "prompt_lookup",
                                                           "speculation_depth": 4})
    assert any(rows > 1 for rows in calls)
    assert max(calls) <= screen_max_rows()
    off, _ = await _greedy(tiny_gemma_dir)
    assert lookup == off


async def test_min_tokens_rows_take_the_screen_and_keep_their_tokens(tiny_gemma_dir, monkeypatch):
    on, on_rows = await _greedy(tiny_gemma_dir, min_tokens=24)
    monkeypatch.setenv("SPECMESH_ARGMAX_SCREEN", "0")
    off, _ = await _greedy(tiny_gemma_dir, min_tokens=24)
    assert on_rows and on_rows > 0
    assert on == off and all(len(ids) == 24 for ids in on)


def test_only_a_processor_that_masks_lets_its_rows_take_the_screen():
    from services.common.sampling_params import SamplingConfig
    from services.target.model.logits_processors import LogitsProcessor

    def masks(**config):
        return LogitsProcessor.for_request(SamplingConfig(max_tokens=8, **config), frozenset({1, 106}), 4).masks_only

    assert masks(min_tokens=4) == (1, 106)  # end-of-sequence, banned while too few tokens were generated
    for changes in ({"logit_bias": ((5, 2.0),)}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5},
                    {"frequency_penalty": 0.5}):
        assert masks(min_tokens=4, **changes) is None, changes


def test_products_of_the_largest_quants_are_summed_without_saturating():
    """Every weight and every row value quantized to +-127 (one magnitude per block), signs agreeing on
    some columns and opposed on others: the largest int8 products there are, where a pairwise int16
    sum that saturated (AVX2's VPMADDUBSW with q + 128 unsigned would) leaves the approximate logit
    far below the exact one and the upper bound below it."""
    n, k = 64, 128
    gen = torch.Generator().manual_seed(5)
    signs = torch.where(torch.rand(n, k, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.where(torch.rand(1, k, generator=gen) < 0.5, -1.0, 1.0)
    signs[:8] = x  # columns that agree with the row everywhere: logit k
    signs[8:16] = -x  # and that oppose it everywhere: -k
    w = (signs * 0.5).to(torch.bfloat16)
    screen = argmax_screen.ArgmaxScreen(lambda ids: w[ids], n, k)
    x = x.to(torch.bfloat16)
    whole = cpu_linear.bf16_linear(x, cpu_linear.pack(w), n).float()  # [1, n]
    upper, best, union = argmax_screen.bounds(x, screen.weights)
    assert whole[0, 0] == k * 0.5 and whole[0, 8] == -k * 0.5
    assert (upper >= whole).all() and (best <= whole.amax(dim=1)).all()
    assert torch.allclose(upper, whole, rtol=1e-3, atol=1e-2)  # exact quants: the bound is float32 slack only
    assert torch.equal(union, torch.arange(8))  # the 8 tied maxima, nothing else


def test_the_narrow_copy_estimate_counts_only_near_ties_where_the_weights_fit_its_bits():
    """benchmarks/argmax_screen.py --narrow-bits: weights that are exactly 4-bit values leave a 4-bit
    copy no quantization error, so only the row's maximum (and the row quantization's slack) is a
    candidate; random weights leave a 4-bit copy far more candidates than a 7-bit one."""
    from benchmarks.argmax_screen import narrow_candidates
    gen = torch.Generator().manual_seed(3)
    n, k = 2048, 64
    q = torch.randint(-7, 8, (n, k), generator=gen).float()
    exact = (q * 0.125).to(torch.bfloat16)  # one scale per block: 4-bit values exactly
    x = torch.randn(4, k, generator=gen).to(torch.bfloat16)
    assert max(narrow_candidates(x, lambda ids: exact[ids], n, 4, 32)) <= 3
    noisy = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    four = narrow_candidates(x, lambda ids: noisy[ids], n, 4, 32)
    seven = narrow_candidates(x, lambda ids: noisy[ids], n, 7, 32)
    assert all(a >= b >= 1 for a, b in zip(four, seven)) and sum(four) > 2 * sum(seven)
