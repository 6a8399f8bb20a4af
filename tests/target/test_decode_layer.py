"""A decode step's layers in one C++ call each (services/target/model/decode_layer.py) give what the
lean forward's nine calls a layer give, bit for bit, for every weight format that call takes."""

from __future__ import annotations

import pytest
import torch

from services.target.engine.block_manager import BlockManager
from services.target.model import decode_layer
from services.target.model.model_runner import ModelRunner, load_model
from services.target.model.model_runner_inputs import StepInput
from tests.target.test_gemma3_forward import EMPTY
from tests.target.test_gguf_weights import gguf_gemma_dir  # noqa: F401  (the fixture)
from tests.target.test_llama_forward import FAMILIES, family_dirs  # noqa: F401  (the fixture)


def _runner(model_dir, weights: str) -> ModelRunner:
    model, _, spec = load_model(model_dir, torch.bfloat16, weights=weights)
    return ModelRunner(model, spec, BlockManager(128, 4), torch.bfloat16, kernels="cpu")


def _run(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill two prompts (one past the sliding window of 16), then decode steps of two rows and of
    one, a mixed step (a chunk beside a decode row: the nine calls), and a draft tree beside a decode
    row (small-tree rows attend as decode rows: the one call)."""
    prompts = {"a": list(range(5, 45)), "c": list(range(200, 207))}
    for seq, ids in prompts.items():
        runner.blocks.admit(seq, EMPTY, len(ids) + 16, len(ids))
    steps = [
        [StepInput.chunk("a", prompts["a"], 0, True), StepInput.chunk("c", prompts["c"][:4], 0, False)],
        [StepInput.chunk("a", [7], 40, True), StepInput.chunk("c", prompts["c"][4:], 4, True)],
        [StepInput.chunk("a", [8], 41, True), StepInput.chunk("c", [9], 7, True)],
        [StepInput.chunk("a", [9], 42, True)],
        [StepInput.tree("a", 11, 43, [12, 13, 14, 15], [-1, 0, 0, 2], [1, 2, 2, 3]),
         StepInput.chunk("c", [10], 8, True)],
    ]
    return [runner.forward(step) for step in steps]


@pytest.mark.parametrize("weights", ["bf16-avx512", "gguf", "gguf-bf16"])
def test_one_call_a_layer_equals_the_nine_calls(gguf_gemma_dir, weights, monkeypatch):  # noqa: F811
    calls = []
    one_call = decode_layer.decode_layer
    monkeypatch.setattr(decode_layer, "decode_layer", lambda *a, **k: calls.append(1) or one_call(*a, **k))
    runner = _runner(gguf_gemma_dir, weights)
    layers = len(runner.lean_forward.layers)
    fused = _run(runner)
    # the two decode steps and the tree step at least, each on every layer but perhaps the last
    # (a step whose last layer computes only its read rows takes the nine calls there)
    assert len(calls) >= 3 * (layers - 1)
    monkeypatch.setenv("SPECMESH_FUSED_DECODE_LAYER", "0")
    taken = len(calls)
    nine_calls = _run(_runner(gguf_gemma_dir, weights))
    assert len(calls) == taken  # the switch keeps every layer on the nine calls
    for got, want in zip(fused, nine_calls):
        assert torch.isfinite(want).all()
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_llama_family_takes_the_same_one_call(family_dirs, family, monkeypatch):  # noqa: F811
    """Llama's norm rounding (weight_after), no post norms, SiLU, Qwen2's q/k/v bias (the panels'
    extra input column), Qwen3's q/k norms, Mistral's window: the same call with the family's
    switches, bit for bit the nine calls."""
    calls = []
    one_call = decode_layer.decode_layer
    monkeypatch.setattr(decode_layer, "decode_layer", lambda *a, **k: calls.append(1) or one_call(*a, **k))
    runner = _runner(family_dirs(family), "bf16-avx512")
    fused = _run(runner)
    assert len(calls) >= 3 * (len(runner.lean_forward.layers) - 1)  # the decode and tree steps, as above
    monkeypatch.setenv("SPECMESH_FUSED_DECODE_LAYER", "0")
    for got, want in zip(fused, _run(_runner(family_dirs(family), "bf16-avx512"))):
        assert torch.isfinite(want).all()
        assert torch.equal(got, want)


def test_a_linear_the_call_cannot_take_keeps_the_nine_calls(gguf_gemma_dir, monkeypatch):  # noqa: F811
    """C++ row ops over linears that are not specmesh's kernels (fbgemm's fp16 here): no one call."""
    calls = []
    monkeypatch.setattr(decode_layer, "decode_layer", lambda *a, **k: calls.append(1))
    runner = _runner(gguf_gemma_dir, "fp16")
    runner.lean_forward = type(runner.lean_forward)(runner.model, row_ops=True)
    logits = _run(runner)
    assert calls == [] and runner.lean_forward.fused_parts(1) is None
    assert all(torch.isfinite(rows).all() for rows in logits)
