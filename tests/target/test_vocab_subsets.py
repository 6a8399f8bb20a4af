"""Logits over a grammar's allowed tokens only (services/target/model/output_layer.py,
services/target/structured/vocab_subsets.py).

- The output layer: a subset row holds the full row's logits at its ids (the same dot products,
  summed in another order) and -inf elsewhere; every other row of the step is unchanged; tied
  (Gemma 3) and untied (Llama) output layers, float32 and bfloat16.
- A step's masks: the ids a row allows are exactly the tokens its mask leaves finite, and a row
  allowing more than the limit gets none.
- Through the mesh: constrained greedy output is token-identical with subsets on and off, with
  and without grammar speculation, while on, rows were computed over subsets.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import xgrammar as xgr

from services.common.models.tiny import TINY_VOCAB_SIZE, build_tiny_tokenizer
from services.target.kernels import cpu_gguf_linear
from services.target.engine.block_manager import BlockManager, PrefixMatch
from services.target.model.model_runner import ModelRunner, load_model
from services.target.model.model_runner_inputs import StepInput
from services.target.structured.grammar_state import GrammarState
from specmesh.proto.v1 import common_pb2
from tests.mesh import collect, request, start_mesh
from tests.structured import ORDER_SCHEMA, PERSON_SCHEMA, valid, valid_order
from tests.target.test_gguf_weights import gguf_gemma_dir  # noqa: F401 (fixture)

EMPTY = PrefixMatch((), (), 0)


def _runner(model_dir, dtype):
    model, _, spec = load_model(model_dir, dtype)
    return ModelRunner(model, spec, BlockManager(64, 4), dtype, kernels="cpu")


def _step(runner, subsets):
    """A prefill chunk sampling its last row, beside a draft tree of 3 nodes: 5 logit rows."""
    runner.blocks.admit("a", EMPTY, 24, 9)
    runner.blocks.admit("b", EMPTY, 24, 6)
    runner.forward([StepInput.chunk("b", list(range(30, 36)), 0, True)])
    inputs = [StepInput.chunk("a", list(range(5, 14)), 0, True),
              StepInput.tree("b", 40, 6, [41, 42, 43], [-1, 0, 0], [1, 2, 2])]
    return runner.forward(inputs, vocab_subsets=subsets)  # [5, vocab]


@pytest.mark.parametrize("arch", ["gemma", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_subset_row_holds_the_full_rows_logits_at_its_ids_and_minus_inf_elsewhere(
        tiny_gemma_dir, tiny_llama_dir, arch, dtype):
    model_dir = tiny_gemma_dir if arch == "gemma" else tiny_llama_dir
    full = _step(_runner(model_dir, dtype), None)
    runner = _runner(model_dir, dtype)
    subsets = {0: torch.tensor([3, 17, 99, 200]), 2: torch.tensor([7]), 4: torch.tensor([0, 383])}
    part = _step(runner, subsets)
    if not runner.takes_vocab_subsets:  # an untied output layer packed for the kernel: every row whole
        assert arch == "llama" and dtype == torch.bfloat16
        assert runner.lean_forward.output.subset_rows == 0
        torch.testing.assert_close(part, full, rtol=2 ** -7, atol=2 ** -7)  # subsets asked for, ignored
        return
    assert runner.lean_forward.output.subset_rows == 3
    # The same dot products summed in another order (or the layer run over fewer rows): one
    # rounding step apart at most.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    for row in range(full.shape[0]):
        if row not in subsets:
            torch.testing.assert_close(part[row], full[row], **tol)  # through the whole layer, as before
            continue
        ids = subsets[row]
        rest = torch.ones(full.shape[1], dtype=torch.bool)
        rest[ids] = False
        assert torch.isinf(part[row, rest]).all() and (part[row, rest] < 0).all()
        torch.testing.assert_close(part[row, ids], full[row, ids], **tol)


def _weight_formats():
    from tests.target.test_gemma3_forward import _formats
    return [w for _, w in _formats() if w != "none"] + (["gguf"] if cpu_gguf_linear.available() else [])


@pytest.mark.parametrize("weights", _weight_formats())
def test_subset_rows_take_the_dtype_of_every_weight_formats_logits(tiny_gemma_dir, gguf_gemma_dir, weights):
    """Packed kernels hand back float32 logits from bf16 rows: a step mixing whole and subset
    rows (and one of subset rows only) keeps that dtype (it once failed to write float32 rows
    into a bf16 buffer on the default model's kernel)."""
    from tests.target.test_gemma3_forward import _runner as format_runner
    model_dir = gguf_gemma_dir if weights == "gguf" else tiny_gemma_dir

    def runner():
        r = format_runner(model_dir, torch.bfloat16, weights)
        r.blocks = BlockManager(64, 4)
        return r
    full = _step(runner(), None)
    for subsets in ({0: torch.tensor([3, 17, 99]), 3: torch.tensor([7])},
                    {row: torch.tensor([row, 40 + row]) for row in range(full.shape[0])}):
        r = runner()
        part = _step(r, subsets)
        assert part.dtype == full.dtype
        if not r.takes_vocab_subsets:  # packed for the kernel, no weight rows to gather: rows whole
            assert weights != "gguf" and r.lean_forward.output.subset_rows == 0
            torch.testing.assert_close(part, full, rtol=2 ** -7, atol=2 ** -7)
            continue
        for row, ids in subsets.items():
            torch.testing.assert_close(part[row, ids], full[row, ids], rtol=2 ** -7, atol=2 ** -7)


def test_allowed_ids_are_the_tokens_the_mask_leaves_and_none_past_the_limit():
    vocab = TINY_VOCAB_SIZE + 8
    info = xgr.TokenizerInfo.from_huggingface(build_tiny_tokenizer(), vocab_size=vocab, stop_token_ids=[2])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(ORDER_SCHEMA), any_whitespace=False)
    state = GrammarState(compiled, vocab)  # compact JSON, as the constraint compiler builds it
    forced = state.forced_tokens(6)
    assert len(forced) >= 2
    masks = state.step_masks(forced[:2], [-1, 0])  # a chain of two forced tokens: 3 masked rows
    rows = torch.zeros(3, vocab)
    state.apply(rows, masks)
    for row in masks.masked:
        ids = masks.allowed_ids(row, vocab, vocab)
        assert ids.tolist() == torch.isfinite(rows[row]).nonzero().flatten().tolist()
        assert masks.allowed_ids(row, ids.numel() - 1, vocab) is None or ids.numel() == 0
    assert state.step_masks(forced[:2], [-1, 0]) is masks  # computed once per step
    # A row the output layer restricted is not masked again (its logits are -inf off its ids):
    masks.restricted.add(masks.masked[0])
    again = torch.zeros(3, vocab)
    state.apply(again, masks)
    assert torch.isfinite(again[masks.masked[0]]).all()
    assert torch.equal(again[list(masks.masked[1:])], rows[list(masks.masked[1:])])
    masks.restricted.clear()
    state.commit(forced[0])
    assert state.step_masks(forced[1:2], [-1]) is not masks  # a commit moves on


async def _outputs(model_dir, **overrides):
    speculation = overrides.pop("speculation", None)
    mesh = await start_mesh(model_dir, speculation=speculation, **overrides)
    try:
        outs = [await collect(mesh.router_stub, request(
                    p, 96, constraint=common_pb2.Constraint(json_schema=json.dumps(schema))))
                for schema in (ORDER_SCHEMA, PERSON_SCHEMA) for p in ("Order:", "the cat sat on the mat. the cat")]
        output = mesh.engine.runner.lean_forward.output
        return outs, output.subset_rows, output.deferred_rows, output.deferred_computed
    finally:
        await mesh.stop()


async def test_constrained_greedy_is_identical_with_subsets_on_and_off_with_and_without_speculation(tiny_llama_dir):
    grammar = {"speculation_method": "grammar", "speculation_depth": 8}
    off, off_rows, _, _ = await _outputs(tiny_llama_dir, grammar_vocab_subsets=False)
    on, on_rows, _, _ = await _outputs(tiny_llama_dir)
    spec_on, spec_rows, deferred, computed = await _outputs(tiny_llama_dir, speculation=grammar)
    assert off_rows == 0 and on_rows > 0 and spec_rows > 0
    # Forced chains' last (whole) rows were left out of the forward, and computed only for the
    # passes whose walk reached them: a chain rejected earlier paid no pass over the vocabulary.
    assert computed < deferred, (computed, deferred)
    for (want, text, last), (a, _, _), (b, _, _) in zip(off, on, spec_on):
        assert (valid_order(text) or valid("json_schema", text)) and last.finish_reason == common_pb2.FINISH_REASON_STOP, text
        assert a == want and b == want
