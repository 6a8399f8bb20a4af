"""The lean Gemma 3 forward equals transformers' forward bit for bit, on every kind of step."""

from __future__ import annotations

import pytest
import torch

from services.target.engine.block_manager import BlockManager, PrefixMatch
from services.target.model.gemma3_forward import Gemma3PagedForward, supports
from services.target.model.model_runner import ModelRunner, load_model
from services.target.model.model_runner_inputs import StepInput

EMPTY = PrefixMatch((), (), 0)


def _runner(model_dir, dtype, weights="auto", fuse=True, row_ops=None):
    """row_ops=False: the lean forward with torch's ops between the matmuls, even beside
    specmesh's kernel (whose default C++ row ops round alike but sum in another order)."""
    model, _, spec = load_model(model_dir, dtype, weights=weights, fuse=fuse)
    runner = ModelRunner(model, spec, BlockManager(128, 4), dtype, kernels="cpu")
    if row_ops is not None and runner.lean_forward is not None:
        runner.lean_forward = type(runner.lean_forward)(model, row_ops=row_ops)  # Gemma 3's or the Llama family's
    return runner


def _steps():
    """Prefill (two whole prompts, one longer than the window of 16, and a chunk), then decode rows
    beside the rest of a prompt, then a draft tree beside a decode row."""
    prompts = {"a": list(range(5, 45)), "b": list(range(100, 123)), "c": list(range(200, 207))}
    tree = StepInput.tree("a", 11, 41, [12, 13, 14, 15], [-1, 0, 0, 2], [1, 2, 2, 3])
    return prompts, [
        [StepInput.chunk("a", prompts["a"], 0, True), StepInput("b", prompts["b"][:12], list(range(12)), 0, 12),
         StepInput.chunk("c", prompts["c"], 0, True)],
        [StepInput.chunk("a", [7], 40, True), StepInput.chunk("b", prompts["b"][12:], 12, True),
         StepInput.chunk("c", [9], 7, True)],
        [tree, StepInput.chunk("c", [10], 8, True)],
    ]


def _run(runner: ModelRunner) -> list[torch.Tensor]:
    prompts, steps = _steps()
    for seq, ids in prompts.items():
        runner.blocks.admit(seq, EMPTY, len(ids) + 16, len(ids))
    return [runner.forward(step) for step in steps]


def _formats():
    from services.target.kernels import cpu_linear
    from services.target.model.linear import native_bf16_cpu
    return [(torch.float32, "none"), (torch.bfloat16, "fp16"), (torch.bfloat16, "int8")] + (
        [(torch.bfloat16, "bf16")] if native_bf16_cpu() else []) + (
        [(torch.bfloat16, "bf16-avx512")] if cpu_linear.available() else [])


def _kernel_available() -> bool:
    from services.target.kernels import cpu_linear
    return cpu_linear.available()


@pytest.mark.parametrize("dtype,weights", _formats())
def test_lean_forward_equals_transformers_on_prefill_decode_and_tree_steps(tiny_gemma_dir, dtype, weights):
    """The lean forward with fused projections against transformers' forward over the model's own,
    unfused modules: the same logits, bit for bit, for every weight format (torch's ops between
    the matmuls; the C++ row ops are checked against them below)."""
    lean = _runner(tiny_gemma_dir, dtype, weights, row_ops=False)
    plain = _runner(tiny_gemma_dir, dtype, weights, fuse=False)
    assert lean.lean_forward is not None and plain.lean_forward is None
    got, expected = _run(lean), _run(plain)
    assert [g.shape[0] for g in got] == [1 + 12 + 1, 3, 5 + 1]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_fused_model_still_runs_transformers_forward(tiny_gemma_dir):
    """q_proj, gate_proj, ... of a fused model are column views of the fused products: transformers'
    own forward over them gives the lean forward's logits."""
    runner = _runner(tiny_gemma_dir, torch.bfloat16, row_ops=False)
    lean = _run(runner)
    runner.lean_forward = None
    for seq in ("a", "b", "c"):
        runner.blocks.release(seq)
    assert all(torch.equal(a, b) for a, b in zip(lean, _run(runner)))


def test_other_models_do_not_take_the_gemma_forward(tiny_llama_dir):
    """(Llama takes its family's lean forward: tests/target/test_llama_forward.py.)"""
    runner = _runner(tiny_llama_dir, torch.float32)
    assert not supports(runner.model) and not isinstance(runner.lean_forward, Gemma3PagedForward)


def test_loading_logs_which_linear_format_was_packed(tiny_gemma_dir, caplog):
    import logging

    from services.target.model.linear import resolve_weight_format
    with caplog.at_level(logging.INFO, logger="services.target.model.model_runner"):
        load_model(tiny_gemma_dir, torch.bfloat16, weights="auto")
    chosen = resolve_weight_format("auto", torch.bfloat16, "cpu")
    assert f"linear layers: {chosen} (asked: auto)" in caplog.text


@pytest.mark.skipif(not _kernel_available(), reason="the AVX-512 kernel does not run here")
def test_row_ops_run_with_the_avx512_kernel_only_and_keep_the_logits(tiny_gemma_dir):
    """The C++ row ops (norms, residual adds, q/k norm + RoPE) replace torch's where the linear
    layers are specmesh's kernel; forced on beside oneDNN/fbgemm layers they give the same greedy
    tokens and logits within bf16 rounding of the torch ops' (tests/target/test_cpu_rowops.py per op)."""
    assert _runner(tiny_gemma_dir, torch.bfloat16, "bf16-avx512").lean_forward.row_ops
    assert not _runner(tiny_gemma_dir, torch.float32, "none").lean_forward.row_ops
    torch_ops = _runner(tiny_gemma_dir, torch.bfloat16, "fp16")
    assert not torch_ops.lean_forward.row_ops
    row_ops = _runner(tiny_gemma_dir, torch.bfloat16, "fp16", row_ops=True)
    for got, expected in zip(_run(row_ops), _run(torch_ops)):
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
