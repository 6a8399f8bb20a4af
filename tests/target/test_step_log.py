"""The step log's breakdowns: which steps a request waited through before its first token,
and what the steps of its decoding carried (read by benchmarks/p99_incident.py)."""

from __future__ import annotations

from services.target.engine.step_log import FirstToken, StepRecord, decode_breakdown, first_token_breakdown


def _step(i: int, start: float, seconds: float, prefill: int = 0, rows: int = 4, nodes: int = 0,
          draft_s: float = 0.0) -> StepRecord:
    return StepRecord(i, start, start + seconds, draft_s, prefill, rows, nodes, 1 if nodes else 0, 0)


def test_first_token_and_decode_breakdowns_split_a_request_at_its_first_token():
    # Steps of 50 ms from t = 0; the request arrives at 0.06, is admitted at 0.10, has its
    # first token at 0.20 and its last at 0.40.
    steps = [_step(0, 0.00, 0.05), _step(1, 0.05, 0.05, prefill=64), _step(2, 0.10, 0.05, prefill=64),
             _step(3, 0.15, 0.05, prefill=32), _step(4, 0.20, 0.05, nodes=6, draft_s=0.004),
             _step(5, 0.25, 0.05), _step(6, 0.30, 0.10, prefill=100), _step(7, 0.40, 0.05)]
    first = FirstToken("r", "qa", arrival=0.06, admitted=0.10, first_token=0.20, cached_prompt_tokens=0,
                       prompt_tokens=160)
    waited = first_token_breakdown(first, steps)
    assert waited["steps"] == 3 and waited["steps_with_prefill"] == 3 and waited["steps_with_verify"] == 0
    assert abs(waited["queue_s"] - 0.04) < 1e-9
    decode = decode_breakdown(0.20, 0.40, steps)  # steps 4, 5 and 6
    assert decode["decode_steps"] == 3
    assert abs(decode["decode_step_s"] - 0.2 / 3) < 1e-9
    assert abs(decode["decode_prefill_tokens"] - 100 / 3) < 1e-9
    assert abs(decode["decode_draft_nodes"] - 2.0) < 1e-9
    assert decode_breakdown(0.45, 0.50, steps) == {"decode_steps": 0}  # nothing ran in its life


def test_the_engine_logs_prompt_chunks_apart_from_decode_rows(tiny_llama_dir):
    """A running engine's step log: the prompt's tokens as prefill, each generated token as a
    decode row (before the fix every row counted as a prompt chunk: a step's rows were
    classified after the step had appended its tokens)."""
    import threading

    from services.common.sampling_params import SamplingConfig
    from tests.target.test_engine_serving import _engine
    engine = _engine(tiny_llama_dir)
    done = threading.Event()
    try:
        ids = engine.tokenize("one two three four five six seven")
        engine.submit("r", ids, SamplingConfig(max_tokens=6, min_tokens=6),
                      lambda out: done.set() if out.finish_reason is not None else None)
        assert done.wait(60)
        steps, _ = engine.step_log.snapshot()
    finally:
        engine.shutdown()
    assert sum(s.prefill_tokens for s in steps) == len(ids)
    assert sum(s.decode_rows for s in steps) == 5  # the first token comes from the prefill step
