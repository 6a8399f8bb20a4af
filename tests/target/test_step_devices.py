"""Every tensor and random draw on the target's step path is made on the model's device.

What the CPU can show: the mesh runs greedy, seeded-sampled and speculating requests (every
proposer) with the step under `DeviceNamingGuard`, which fails on any tensor factory call that
does not name its device and on any draw whose generator is on another device than its tensor.
Before this change the speculator built its tree tensors and uniforms without a device and the
model runner its attention metadata, so that check failed. On the CPU the named device is
always the CPU: the guard cannot tell a right device from a wrong one, only that none is left
to the default. The `cuda` cases below run the sampler and the verify walk on a GPU where one
is present (skipped, marked, elsewhere).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.draft_tree import DraftTree
from services.common.sampling_params import SamplingConfig
from services.target.engine.engine import Engine
from services.target.kernels.select import get_kernels
from services.target.model.sampler import make_generator, sample
from services.target.speculation.speculator import Speculator
from tests.e2e.test_generate import hf_greedy
from tests.mesh import collect, request, start_draft, start_mesh
from tests.target.device_guard import DeviceNamingGuard

PROMPTS = ["1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4", "the cat sat on the mat. the cat sat on the"]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device here"))]


@pytest.fixture
def guarded_steps(monkeypatch):
    """Runs every engine step (draft call, forward, sampling, verify) under one guard."""
    guard = DeviceNamingGuard()
    execute = Engine._execute

    def guarded(self, batch):
        with guard:
            return execute(self, batch)
    monkeypatch.setattr(Engine, "_execute", guarded)
    return guard


@pytest.mark.parametrize("method,depth,nodes", [
    (None, 0, 0), ("prompt_lookup", 4, 0), ("suffix", 3, 8), ("draft_model", 3, 0), ("dynamic_tree", 3, 8)])
async def test_step_path_names_the_device_of_every_tensor_and_generator(
        tiny_llama_dir, guarded_steps, method, depth, nodes):
    """Greedy and seeded-sampled requests, plain or speculating, through the mesh; kernels
    "reference" (the device-generic ones that run beside Triton's; the "cpu" backend's C++
    attention planning runs on the CPU only)."""
    draft = await start_draft(tiny_llama_dir) if method else None
    speculation = {"speculation_method": method, "speculation_depth": depth, "speculation_nodes": nodes}
    mesh = await start_mesh(tiny_llama_dir, speculation=speculation if method else None,
                            draft_address=draft.address if draft else "", kernels="reference")
    try:
        greedy = await asyncio.gather(*(collect(mesh.router_stub, request(p, 16)) for p in PROMPTS))
        # min_tokens: a seeded sample may draw the end-of-sequence token early on another CPU
        sampled = await collect(mesh.router_stub, request(PROMPTS[1], 16, temperature=0.8, top_p=0.9,
                                                          seed=5, min_tokens=16))
        # Penalties, bias, min_tokens and log-probabilities make tensors of their own each step.
        processed = await collect(mesh.router_stub, request(
            PROMPTS[0], 8, temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.3,
            repetition_penalty=1.2, logit_bias={5: 2.0}, min_tokens=8, logprobs=True, top_logprobs=2))
    finally:
        await mesh.stop()
        if draft:
            await draft.stop(grace=0.5)
    assert guarded_steps.calls > 0
    sites = sorted(set(guarded_steps.violations))  # each site once
    assert not sites, "\n".join(sites)
    for prompt, (ids, _, _) in zip(PROMPTS, greedy):
        assert ids == hf_greedy(tiny_llama_dir, prompt, 16)
    assert len(sampled[0]) == 16
    assert len(processed[0]) == 8


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_draws_on_the_device_of_the_probabilities(device):
    """Seeded temperature / top-k / top-p sampling on logits of `device`: every factory names a
    device and every generator is the probabilities' (the generator is made for that device)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(device)
    configs = [SamplingConfig(max_tokens=4, temperature=0.7, top_k=10, seed=1),
               SamplingConfig(max_tokens=4, temperature=1.0, top_p=0.5, seed=2),
               SamplingConfig(max_tokens=4)]
    generators = [make_generator(c.seed, logits.device) for c in configs]
    assert all(g.device == logits.device for g in generators)
    guard = DeviceNamingGuard()
    with guard:
        tokens = sample(logits, configs, generators)
    assert guard.violations == [] and guard.calls > 0
    assert all(isinstance(t, int) and 0 <= t < 50 for t in tokens)
    again = sample(logits, configs, [make_generator(c.seed, logits.device) for c in configs])
    assert again == tokens  # seeded


class _Seq:
    """The parts of a Sequence that the verify walk reads."""

    def __init__(self, sampling: SamplingConfig, device) -> None:
        from services.target.engine.sequence import SpeculationStats
        self.seq_id = "s"
        self.token_ids = [1, 5, 6]
        self.sampling = sampling
        self.generator = make_generator(sampling.seed, device)
        self.spec = SpeculationStats()
        self.grammar = None  # unconstrained, no penalties or bias
        self.logits_processor = None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_walk_builds_its_tensors_on_the_logits_device(device, temperature):
    """Speculator.accept over a tree's logits on `device`: the draft tokens, parents, counts and
    uniforms it hands the accept kernel are made there (the kernels check devices)."""
    speculator = Speculator(client=None, kernels=get_kernels("reference"), max_context=64, metrics=None)
    proposal = DraftTree("s", (7, 8, 9), (-1, 0, 0))
    rows = torch.randn(4, 20, generator=torch.Generator().manual_seed(1)).to(device)  # [1 + nodes, vocab]
    rows[0, 7] = rows[1, 8] = 50.0  # the target agrees with nodes 0 and 1
    seq = _Seq(SamplingConfig(max_tokens=8, temperature=temperature, seed=4), rows.device)
    guard = DeviceNamingGuard()
    with guard:
        path, bonus, _ = speculator.accept(seq, rows, proposal)
    assert guard.violations == [] and guard.calls > 0
    assert path == [0, 1] and 0 <= bonus < 20
