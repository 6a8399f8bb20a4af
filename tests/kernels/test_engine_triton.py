"""The whole engine (scheduler, paged KV, continuous batching) with the Triton kernels forced
under the interpreter equals the reference kernels' greedy output."""

from __future__ import annotations

import threading

import pytest

from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine

pytestmark = pytest.mark.triton


def _generate(model_dir, kernels: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="float32", num_blocks=64, block_size=4,
                                      max_batched_tokens=16, kernels=kernels))
    engine.start()
    outputs = [[] for _ in prompts]
    done = threading.Semaphore(0)
    try:
        for i, prompt in enumerate(prompts):
            def emit(out, i=i):
                outputs[i].extend(out.token_ids)
                if out.finish_reason is not None:
                    done.release()
            engine.submit(f"r{i}", engine.tokenize(prompt), SamplingConfig(max_tokens=max_tokens), emit)
        for _ in prompts:
            assert done.acquire(timeout=300)
    finally:
        engine.shutdown()
    return outputs


def test_engine_with_triton_kernels_equals_reference(tmp_path):
    from services.common.models.tiny import build_tiny_model
    model_dir = build_tiny_model(tmp_path / "tiny-gemma", arch="gemma3", seed=2)
    # The second prompt is longer than one 16-token prefill budget and the sliding window (16).
    prompts = ["Once upon a time", "The quick brown fox jumps over the lazy dog and then"]
    reference = _generate(model_dir, "reference", prompts, 6)
    triton = _generate(model_dir, "triton", prompts, 6)
    assert triton == reference
    assert all(len(o) == 6 for o in reference)
