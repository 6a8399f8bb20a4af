"""The default Gemma 3 270M through the engine equals Hugging Face in float32.

Loads the prepared default model (`specmesh models prepare`, converted on first use).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.settings import read_settings
from services.common.models.prepare import prepare_default_model
from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine

pytestmark = pytest.mark.slow

# Greedy logits of the paged engine and of Hugging Face's eager/SDPA path differ only
# by float32 summation order.
LOGIT_ATOL = 2e-3
NEW_TOKENS = 32


def _long_prompt() -> str:
    facts = [f"Fact {i}: the number {i} squared is {i * i}." for i in range(60)]
    return "Read these facts carefully.\n" + "\n".join(facts) + "\nNow continue the list:\nFact 60:"


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", _long_prompt()]


@pytest.fixture(scope="module")
def default_dir() -> Path:
    settings = read_settings()
    return prepare_default_model(Path(settings.model_cache).expanduser() / "gemma-3-270m", progress=False)


@pytest.fixture(scope="module")
def hf_model(default_dir):
    return AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(default_dir):
    engine = Engine.load(EngineConfig(model_dir=default_dir, dtype="float32", num_blocks=160,
                                      block_size=16, max_batched_tokens=256, kernels="reference"))
    yield engine
    engine.shutdown()


def _engine_greedy(engine: Engine, prompt_ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Runs prefill + decode through the engine's runner, keeping the logits of every step."""
    captured: list[torch.Tensor] = []
    forward = engine.runner.forward

    def recording_forward(batch, **kwargs):  # whole rows, even those marked for the argmax screen
        logits = forward(batch)
        if logits.shape[0]:  # prefill chunks that end mid-prompt sample nothing
            captured.append(logits[0].clone())
        return logits

    engine.runner.forward = recording_forward
    done = threading.Event()
    tokens: list[int] = []

    def emit(out):
        tokens.extend(out.token_ids)
        if out.finish_reason is not None:
            done.set()
    try:
        engine.start()
        engine.submit("r", prompt_ids, SamplingConfig(max_tokens=NEW_TOKENS), emit)
        assert done.wait(300)
    finally:
        engine.runner.forward = forward
    return tokens, captured


def test_default_model_greedy_and_logits_match_hugging_face(default_dir, hf_model, engine):
    tokenizer = AutoTokenizer.from_pretrained(default_dir)
    assert hf_model.config.sliding_window == 512
    lengths = []
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt).input_ids
        lengths.append(len(prompt_ids))
        ids = torch.tensor([prompt_ids])
        expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False)[0, len(prompt_ids):].tolist()
        tokens, step_logits = _engine_greedy(engine, prompt_ids)
        assert tokens == expected, prompt[:40]
        # Teacher-forced HF logits at each position the engine sampled from.
        full = torch.tensor([prompt_ids + tokens[:-1]])
        with torch.inference_mode():
            hf_logits = hf_model(full).logits[0, len(prompt_ids) - 1:].float()  # [steps, vocab]
        engine_logits = torch.stack(step_logits)
        assert torch.allclose(engine_logits, hf_logits, atol=LOGIT_ATOL, rtol=0), \
            f"max logit difference {(engine_logits - hf_logits).abs().max():.2e}"
    assert max(lengths) > 512  # one prompt crosses Gemma's sliding window
