"""The lean Gemma 3 forward equals transformers' forward bit for bit, on every kind of step."""

from __future__ import annotations

import pytest
import torch

from services.target.block_manager import BlockManager, PrefixMatch
from services.target.gemma3_forward import supports
from services.target.model_runner import ModelRunner, load_model
from services.target.model_runner_inputs import StepInput

EMPTY = PrefixMatch((), (), 0)


def _runner(model_dir, dtype):
    model, _, spec = load_model(model_dir, dtype, weights="auto")
    return ModelRunner(model, spec, BlockManager(128, 4), dtype, kernels="cpu")


def _both(runner: ModelRunner, inputs: list[StepInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the lean forward and of transformers' forward for the same step. Both write the
    same KV (bit-identical), so running one after the other leaves the pool as one run would."""
    lean = runner.forward(inputs)
    saved, runner.lean_forward = runner.lean_forward, None
    try:
        return lean, runner.forward(inputs)
    finally:
        runner.lean_forward = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_equals_transformers_on_prefill_decode_and_tree_steps(tiny_gemma_dir, dtype):
    runner = _runner(tiny_gemma_dir, dtype)
    assert runner.lean_forward is not None
    blocks = runner.blocks
    prompts = {"a": list(range(5, 45)), "b": list(range(100, 123)), "c": list(range(200, 207))}
    for seq, ids in prompts.items():
        blocks.admit(seq, EMPTY, len(ids) + 16, len(ids))
    # A mixed prefill step: two whole prompts (one longer than the sliding window of 16) and a chunk.
    lean, hf = _both(runner, [StepInput.chunk("a", prompts["a"], 0, True),
                              StepInput("b", prompts["b"][:12], list(range(12)), 0, 12),
                              StepInput.chunk("c", prompts["c"], 0, True)])
    assert lean.shape == (1 + 12 + 1, runner.spec.vocab_size) and torch.equal(lean, hf)
    # Decode rows beside the rest of b's prompt, then a draft tree beside a decode row.
    lean, hf = _both(runner, [StepInput.chunk("a", [7], 40, True), StepInput.chunk("b", prompts["b"][12:], 12, True),
                              StepInput.chunk("c", [9], 7, True)])
    assert torch.equal(lean, hf)
    tree = StepInput.tree("a", 11, 41, [12, 13, 14, 15], [-1, 0, 0, 2], [1, 2, 2, 3])
    lean, hf = _both(runner, [tree, StepInput.chunk("c", [10], 8, True)])
    assert lean.shape[0] == 5 + 1 and torch.equal(lean, hf)


def test_other_models_keep_transformers_forward(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, torch.float32)
    assert not supports(runner.model) and runner.lean_forward is None
