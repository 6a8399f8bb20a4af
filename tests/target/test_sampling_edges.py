"""A numeric edge in one request's sampling never fails another request.

Each case runs an edge request beside an ordinary greedy one in the same engine steps.
"""

from __future__ import annotations

import threading

import pytest
import torch

from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.model.sampler import SamplingError, make_generator, sample, target_probs

PROMPT = "The quick brown fox jumps over the lazy dog and"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = Engine.load(EngineConfig(model_dir=tiny_llama_dir, dtype="float32", num_blocks=256,
                                      block_size=4, kernels="reference"))
    engine.start()
    yield engine
    engine.shutdown()


class _Stream:
    """Collects one request's outputs from the engine thread."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.final = None
        self.done = threading.Event()

    def __call__(self, out) -> None:
        self.token_ids.extend(out.token_ids)
        if out.finish_reason is not None or out.error is not None:
            self.final = out
            self.done.set()


def _run_together(engine, configs: dict[str, SamplingConfig]) -> dict[str, _Stream]:
    ids = engine.tokenize(PROMPT)
    streams = {name: _Stream() for name in configs}
    for name, config in configs.items():
        engine.submit(name, ids, config, streams[name])
    for stream in streams.values():
        assert stream.done.wait(60)
    return streams


@pytest.mark.parametrize("edge", [
    dict(temperature=1e-40),  # subnormal: logits / T overflowed to inf, softmax gave NaN
    dict(temperature=1e-45),  # rounds to float32's smallest subnormal
    dict(temperature=1.0, top_p=1e-30),  # a nucleus of one token
    dict(temperature=1e-40, top_k=2**31 - 1, top_p=1e-30),
])
def test_numeric_edges_give_the_greedy_token_and_the_other_stream_completes(engine, edge):
    streams = _run_together(engine, {
        "edge": SamplingConfig(max_tokens=12, seed=3, **edge),
        "other": SamplingConfig(max_tokens=12),
    })
    assert streams["edge"].final.error is None and streams["other"].final.error is None
    # Almost-zero temperature (or a nucleus of one token) is greedy decoding.
    assert streams["edge"].token_ids == streams["other"].token_ids
    assert len(streams["other"].token_ids) == 12


def test_huge_temperature_samples_valid_tokens(engine):
    streams = _run_together(engine, {
        "hot": SamplingConfig(max_tokens=12, temperature=3e38, seed=5),
        "other": SamplingConfig(max_tokens=12),
    })
    assert streams["hot"].final.error is None
    assert all(0 <= t < engine.spec.vocab_size for t in streams["hot"].token_ids)
    assert len(streams["other"].token_ids) == 12


def test_nan_logits_fail_only_their_own_request(engine):
    """A sequence whose logits are all NaN ends with a SamplingError; its neighbour is unchanged."""
    expected = _run_together(engine, {"alone": SamplingConfig(max_tokens=8)})["alone"].token_ids
    forward = engine.runner.forward

    def poisoned(inputs, **kwargs):  # whole rows: the poison must reach the sampler as written
        logits = forward(inputs).clone()  # [num_rows, vocab]
        offset = 0
        for inp in inputs:
            if inp.seq_id.startswith("poison") and inp.num_logits:
                logits[offset:offset + inp.num_logits] = float("nan")
            offset += inp.num_logits
        return logits
    engine.runner.forward = poisoned
    try:
        streams = _run_together(engine, {
            "poison-greedy": SamplingConfig(max_tokens=8),
            "poison-sampled": SamplingConfig(max_tokens=8, temperature=0.7, seed=1),
            "other": SamplingConfig(max_tokens=8),
        })
    finally:
        engine.runner.forward = forward
    assert isinstance(streams["poison-greedy"].final.error, SamplingError)
    assert isinstance(streams["poison-sampled"].final.error, SamplingError)
    assert streams["other"].final.error is None
    assert streams["other"].token_ids == expected
    assert engine.live_request_ids() == set()


def test_overflowing_logits_choose_the_infinite_token():
    logits = torch.zeros(3, 10)  # [num_seqs, vocab]
    logits[0, 7] = float("inf")
    logits[1, 2] = float("inf")
    logits[1, 5] = float("nan")
    logits[2, 4] = 3e38  # finite, but overflows once divided by a small temperature
    configs = [SamplingConfig(4, temperature=0.5, seed=0), SamplingConfig(4),
               SamplingConfig(4, temperature=1e-3, seed=0)]
    assert sample(logits, configs, [make_generator(0, logits.device) for _ in configs]) == [7, 2, 4]


def test_target_probs_are_a_distribution_at_every_edge():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))  # [n, vocab]
    logits[1, 3] = float("inf")
    logits[2, :10] = float("nan")
    logits[3] = 1e30
    for config in [SamplingConfig(4, temperature=1e-40), SamplingConfig(4, temperature=3e38),
                   SamplingConfig(4, temperature=1.0, top_p=1e-30),
                   SamplingConfig(4, temperature=1.0, top_k=2**31 - 1)]:
        probs = target_probs(logits, config)  # [4, 50]
        assert torch.isfinite(probs).all() and (probs >= 0).all()
        assert torch.allclose(probs.sum(-1), torch.ones(4))
        assert probs[2, :10].sum() == 0  # NaN logits are never chosen
    with pytest.raises(SamplingError):
        target_probs(torch.full((1, 5), float("nan")), SamplingConfig(4, temperature=1.0))
