"""End to end through real gRPC servers on loopback: router -> target with a tiny model."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.mesh import collect, request, start_mesh

PROMPTS = ["The quick brown fox", "Once upon a time there was", "a", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16"]


def hf_greedy(model_dir, prompt: str, max_new_tokens: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(prompt).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
async def test_greedy_output_equals_hugging_face_generate(arch, tiny_llama_dir, tiny_gemma_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_gemma_dir
    mesh = await start_mesh(model_dir)
    try:
        for prompt in PROMPTS:
            ids, text, last = await collect(mesh.router_stub, request(prompt, max_tokens=24))
            expected = hf_greedy(model_dir, prompt, 24)
            assert ids == expected, prompt
            assert last.usage.completion_tokens == len(ids)
            assert last.usage.prompt_tokens > 0
    finally:
        await mesh.stop()


async def test_concurrent_streams_each_get_their_own_tokens(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, max_batched_tokens=16)  # forces chunked prefill
    try:
        expected = [hf_greedy(tiny_llama_dir, p, 20) for p in PROMPTS]
        results = await asyncio.gather(*(collect(mesh.router_stub, request(p, max_tokens=20))
                                          for p in PROMPTS * 2))
        for i, (ids, _, _) in enumerate(results):
            assert ids == expected[i % len(PROMPTS)]
    finally:
        await mesh.stop()


async def test_seeded_sampling_is_reproducible_and_seeds_differ(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        def sampled(seed):
            return request("Once upon a time", max_tokens=24, temperature=1.0, top_p=0.9,
                           top_k=50, seed=seed, has_seed=True)
        first, second, other = await asyncio.gather(
            collect(mesh.router_stub, sampled(7)), collect(mesh.router_stub, sampled(7)),
            collect(mesh.router_stub, sampled(8)))
        assert first[0] == second[0]
        assert first[0] != other[0]
    finally:
        await mesh.stop()


async def test_stop_sequence_ends_the_stream_without_the_stop_text(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        _, full_text, _ = await collect(mesh.router_stub, request("The quick brown fox", max_tokens=24))
        stop = full_text[len(full_text) // 2: len(full_text) // 2 + 2]
        assert stop.strip(), f"need visible text to stop on, got {full_text!r}"
        _, text, last = await collect(mesh.router_stub, request("The quick brown fox", max_tokens=24,
                                                                stop=[stop]))
        assert text == full_text[:full_text.index(stop)]
        assert last.finish_reason == 3  # FINISH_REASON_STOP_SEQUENCE
    finally:
        await mesh.stop()
