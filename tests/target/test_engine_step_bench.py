"""benchmarks/engine_step.py's harness on a tiny Gemma 3: real forwards over the pool, blocks freed."""

from __future__ import annotations

import pytest

from benchmarks.engine_step import StepBench
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.model.output_layer import ARGMAX_ONLY


def test_step_bench_prefills_and_decodes_and_frees_its_blocks(tiny_gemma_dir):
    engine = Engine.load(EngineConfig(model_dir=tiny_gemma_dir, dtype="float32", num_blocks=128, block_size=4))
    try:
        ids = engine.tokenizer("the lighthouse keeper climbed the stairs " * 8).input_ids[:40]
        bench = StepBench(engine, ids, chunk=16)
        free = engine.blocks.num_free
        calls = []
        forward = engine.runner.forward
        engine.runner.forward = lambda inputs, **kw: calls.append([(i.seq_id, len(i.token_ids), i.context_len)
                                                                   for i in inputs]) or forward(inputs, **kw)

        def run():
            return bench.timed_prefills(40, 2), bench.decode_steps([5, 12], 3)
        prefills, steps = engine.run_on_engine_thread(run)
        assert len(prefills) == 2 and len(steps) == 3 and all(t > 0 for t in prefills + steps)
        # prefills in chunks of 16 (40 = 16 + 16 + 8), then the two contexts, then 3 steps of 2 rows
        assert calls[:3] == [[("prefill-0", 16, 0)], [("prefill-0", 16, 16)], [("prefill-0", 8, 32)]]
        assert calls[-3:] == [[("decode-0", 1, 5 + k), ("decode-1", 1, 12 + k)] for k in range(3)]
        assert engine.blocks.num_free == free  # every sequence it opened is released
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_decode_rows_are_marked_for_the_argmax_screen_where_the_forward_takes_them(tiny_gemma_dir, dtype):
    """--greedy: every decode row read by its argmax alone, as the engine marks plain greedy rows, where
    the forward computes such rows through the screen; elsewhere the flag changes nothing."""
    engine = Engine.load(EngineConfig(model_dir=tiny_gemma_dir, dtype=dtype, num_blocks=128, block_size=4))
    try:
        ids = engine.tokenizer("the lighthouse keeper climbed the stairs " * 8).input_ids[:40]
        bench = StepBench(engine, ids, chunk=16, greedy=True)
        assert bench.greedy == engine.runner.takes_argmax_rows
        seen = []
        forward = engine.runner.forward
        engine.runner.forward = lambda inputs, vocab_subsets=None: seen.append(vocab_subsets) or forward(
            inputs, vocab_subsets=vocab_subsets)
        engine.run_on_engine_thread(lambda: bench.decode_steps([5, 12], 2))
        steps = seen[-2:]
        if bench.greedy:
            assert steps == [{0: ARGMAX_ONLY, 1: ARGMAX_ONLY}] * 2
        else:
            assert steps == [None, None]
    finally:
        engine.shutdown()
