"""The last layer computes past its keys and values only the rows whose output is read
(services/target/model/output_rows.py): the logit rows of prefill chunks and decode rows, none of a
chunk that is not its prompt's last; trees, prompt log-probabilities and features keep every row."""

from __future__ import annotations

import pytest
import torch

from services.target.engine.block_manager import BlockManager, PrefixMatch
from services.target.model.model_runner import ModelRunner, load_model
from services.target.model.model_runner_inputs import StepInput

EMPTY = PrefixMatch((), (), 0)


def _runner(model_dir) -> ModelRunner:
    model, _, spec = load_model(model_dir, torch.bfloat16, weights="bf16-avx512")
    runner = ModelRunner(model, spec, BlockManager(128, 4), torch.bfloat16, kernels="cpu")
    assert runner.lean_forward.row_ops and runner.lean_forward.takes_output_rows
    return runner


def _record_last_layer_rows(runner: ModelRunner) -> list[int]:
    """The row counts the last layer's output projection is called with, one per forward."""
    layer = runner.lean_forward.layers[-1]
    calls, project = [], layer.o_proj

    def recorded(x):
        calls.append(x.shape[0])
        return project(x)
    layer.o_proj = recorded
    return calls


def _steps():
    """Two prompts in chunks (a's first chunk is not its last), one with a logit on every row (prompt
    log-probabilities), then decode rows beside a's last chunk, then a draft tree."""
    prompts = {"a": list(range(5, 45)), "b": list(range(100, 112)), "c": list(range(200, 207))}
    return prompts, [
        [StepInput.chunk("a", prompts["a"][:24], 0, False), StepInput("b", prompts["b"], list(range(12)), 0, 12),
         StepInput.chunk("c", prompts["c"], 0, True)],
        [StepInput.chunk("a", prompts["a"][24:], 24, True), StepInput.chunk("b", [7], 12, True),
         StepInput.chunk("c", [9], 7, True)],
        [StepInput.chunk("a", [3], 40, False)],
        [StepInput.tree("c", 10, 8, [12, 13, 14, 15], [-1, 0, 0, 2], [1, 2, 2, 3])],
    ]


def _run(runner: ModelRunner) -> list[torch.Tensor]:
    prompts, steps = _steps()
    for seq, ids in prompts.items():
        runner.blocks.admit(seq, EMPTY, len(ids) + 16, len(ids))
    return [runner.forward(step) for step in steps]


@pytest.mark.parametrize("model", ["tiny_gemma_dir", "tiny_llama_dir"])
def test_the_last_layer_runs_only_the_rows_read_and_keeps_their_logits(model, request, monkeypatch):
    # the rows are counted at the last layer's o_proj: every layer's nine calls (not decode_layer.py's one)
    monkeypatch.setenv("SPECMESH_FUSED_DECODE_LAYER", "0")
    model_dir = request.getfixturevalue(model)
    read = _runner(model_dir)
    rows = _record_last_layer_rows(read)
    got = _run(read)
    # step 1: none of a's first chunk, all 12 of b, c's last row; step 2: a's last row and two decode
    # rows; step 3: a chunk that gives no logits; step 4: the tree's every row
    assert rows == [12 + 1, 3, 0, 5]
    assert [g.shape[0] for g in got] == [13, 3, 0, 5]

    whole = _runner(model_dir)
    monkeypatch.setattr(type(whole.lean_forward), "takes_output_rows", property(lambda self: False))
    whole_rows = _record_last_layer_rows(whole)
    expected = _run(whole)
    assert whole_rows == [24 + 12 + 7, 16 + 1 + 1, 1, 5]
    for g, e in zip(got, expected):
        # a read row's keys, values and every layer below are the same; its last attention is a
        # decode row's call instead of its chunk's: equal bit for bit on the AVX512-BF16 EPYC (a
        # 1,300-token prefill of the default model too), bf16 rounding apart where a chunk's attention
        # goes to oneDNN's matmuls instead (CPUs with AMX)
        assert torch.equal(g.argmax(-1), e.argmax(-1))
        torch.testing.assert_close(g, e, atol=0.05, rtol=0.02)


def test_rows_whose_features_are_asked_for_keep_every_row(tiny_gemma_dir):
    """A sequence speculating with the feature head needs the last layer's output of all its rows."""
    runner = _runner(tiny_gemma_dir)
    rows = _record_last_layer_rows(runner)
    runner.blocks.admit("a", EMPTY, 40, 24)
    logits, features = runner.forward_with_features([StepInput.chunk("a", list(range(5, 29)), 0, True)],
                                                    feature_seqs=frozenset({"a"}))
    assert rows == [24] and logits.shape[0] == 1 and features["a"].shape[0] == 24


def test_read_rows_that_are_not_a_sequences_last_keep_every_row():
    from services.target.model.output_rows import output_rows
    from services.target.model.step_plan import StepPlan

    def plan(logit_rows, parents=None):  # two sequences of 3 and 2 rows
        return StepPlan([1, 2, 3, 4, 5], [0, 1, 2, 0, 1], [0, 1, 2, 8, 9], logit_rows, [3, 2], [0, 0],
                        [[0], [2]], parents)

    def metadata(*args):
        return args
    read = output_rows(plan([2, 4]), metadata, "cpu")
    assert read.rows.tolist() == [2, 4] and read.logit_rows.tolist() == [0, 1]
    assert read.meta == ([2, 9], [2, 1], [1, 1], [2, 1], [[0], [2]], None)  # slots, positions, q_lens, contexts
    assert output_rows(plan([1, 4]), metadata, "cpu") is None  # a's read row is not its last
    assert output_rows(plan([4, 2]), metadata, "cpu") is None  # not ascending
    assert output_rows(plan([0, 1, 2, 3, 4]), metadata, "cpu") is None  # every row read
    assert output_rows(plan([2, 4], parents=[-1, 0, 1, -1, 0]), metadata, "cpu") is None  # a tree
    nothing = output_rows(plan([]), metadata, "cpu")
    assert nothing.rows.numel() == 0 and nothing.meta is None
