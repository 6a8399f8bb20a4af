"""`--weights int8`: accuracy against the unquantized model within the stated bound, and the
engine serves with it end to end."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.model.linear import Int8Linear, prepack_linears
from services.bench.quantization import greedy_agreement

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1 2 3 4 5 6 7 8", "def add(a, b):"]


def test_int8_greedy_agreement_and_logprob_gap_within_the_stated_bound(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    test = copy.deepcopy(ref)
    assert prepack_linears(test, "int8") == sum(isinstance(m, torch.nn.Linear) for m in ref.modules())
    with torch.inference_mode():
        sequences = [ref.generate(torch.tensor([tokenizer(p).input_ids]), max_new_tokens=32,
                                  do_sample=False)[0].tolist() for p in PROMPTS]
    result = greedy_agreement(ref, test, sequences)
    # Stated bound for random tiny models (small logit margins): >= 75% of greedy choices agree
    # and the reference's choice loses < 0.06 nats on average. Measured: 80-82% and
    # 0.008-0.034 nats over three seeds. On the default model see README (int8 weights).
    assert result.greedy_agreement >= 0.75, result
    assert 0 <= result.mean_logprob_gap < 0.06, result


def test_engine_serves_with_int8_weights(tiny_llama_dir):
    engine = Engine.load(EngineConfig(model_dir=tiny_llama_dir, dtype="float32", weights="int8",
                                      num_blocks=64, block_size=4))
    assert isinstance(engine.runner.model.lm_head, Int8Linear)
    engine.start()
    try:
        import threading
        done, tokens = threading.Event(), []

        def emit(out):
            tokens.extend(out.token_ids)
            if out.finish_reason is not None:
                done.set()
        engine.submit("q", engine.tokenize("Once upon a time"), SamplingConfig(max_tokens=8), emit)
        assert done.wait(60)
        assert len(tokens) == 8
    finally:
        engine.shutdown()


def test_int8_rows_are_quantized_each_with_its_own_scale():
    # A prefill chunk whose first row is 1,000x the others (Gemma's first token is like that):
    # with one activation scale per call the other rows would round to a few levels.
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=True)
    packed = Int8Linear(linear)
    rows = torch.randn(6, 64)
    chunk = torch.cat([rows[:1] * 1000, rows[1:]])
    with torch.inference_mode():
        exact = torch.nn.functional.linear(chunk, linear.weight, linear.bias)  # [6, 32]
        got = packed(chunk)
        alone = torch.cat([packed(chunk[i:i + 1]) for i in range(6)])  # each row quantized on its own

    def rel(a):  # [6] relative error of each row against the float product
        return (a - exact).norm(dim=1) / exact.norm(dim=1)
    assert rel(got).max() < 0.05, rel(got)  # every row within int8 error, the small rows included
    assert (rel(got) - rel(alone)).abs().max() < 0.02, (rel(got), rel(alone))  # as good as alone
