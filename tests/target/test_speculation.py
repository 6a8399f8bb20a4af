"""Speculative decoding across the draft and target services stays lossless."""

from __future__ import annotations

import asyncio

import pytest

from tests.mesh import collect, request, start_draft, start_mesh
from tests.e2e.test_generate import hf_greedy

# Copy-heavy prompts give prompt lookup and suffix decoding something to match.
PROMPTS = [
    "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4",
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "Once upon a time",
]


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    """A different tiny model with the same tokenizer: a realistic, imperfect draft."""
    from services.common.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), arch="llama", seed=7)


async def _run(model_dir, draft_dir, method, depth, nodes=0, max_tokens=24, prompts=PROMPTS, **engine):
    draft = await start_draft(draft_dir)
    mesh = await start_mesh(model_dir, draft_address=draft.address, speculation={
        "speculation_method": method, "speculation_depth": depth, "speculation_nodes": nodes}, **engine)
    try:
        return await asyncio.gather(*(collect(mesh.router_stub, request(p, max_tokens)) for p in prompts))
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)


@pytest.mark.parametrize("method,depth,nodes", [
    ("prompt_lookup", 5, 0),
    ("suffix", 4, 12),  # trees
    ("draft_model", 4, 0),
    ("dynamic_tree", 3, 10),  # trees
])
async def test_greedy_speculation_equals_target_only(tiny_llama_dir, tiny_draft_dir, method, depth, nodes):
    results = await _run(tiny_llama_dir, tiny_draft_dir, method, depth, nodes)
    for prompt, (ids, _, last) in zip(PROMPTS, results):
        assert ids == hf_greedy(tiny_llama_dir, prompt, 24), (method, prompt)
        assert last.usage.completion_tokens == 24
    usage = [r[2].usage for r in results]
    assert sum(u.proposed_tokens for u in usage) > 0, "no draft tokens were verified"
    for u in usage:
        assert u.rejected_tokens == u.proposed_tokens - u.accepted_tokens
        assert u.acceptance_length == 0 or u.acceptance_length >= 1


@pytest.mark.parametrize("method,nodes", [("draft_model", 0), ("dynamic_tree", 9)])
async def test_draft_equal_to_target_accepts_the_full_depth(tiny_llama_dir, method, nodes):
    depth = 4
    # 1 token from prefill, then passes of depth + 1 tokens: 1 + 5 * 5 = 26. The budget holds
    # every prompt and every tree (a prefill comes before draft slots, which would otherwise
    # lose a pass to a later request's prompt).
    results = await _run(tiny_llama_dir, tiny_llama_dir, method, depth, nodes, max_tokens=26,
                         max_batched_tokens=256)
    for prompt, (ids, _, last) in zip(PROMPTS, results):
        assert ids == hf_greedy(tiny_llama_dir, prompt, 26)
        usage = last.usage
        assert usage.accepted_tokens == 5 * depth
        assert usage.acceptance_length == pytest.approx(depth + 1)
        if method == "draft_model":
            assert usage.proposed_tokens == usage.accepted_tokens


async def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama_dir):
    draft = await start_draft(tiny_llama_dir)
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address, speculation={
        "speculation_method": "draft_model", "speculation_depth": 4})
    try:
        def sampled():
            return request("Once upon a time", 24, temperature=0.8, top_p=0.95, seed=11, has_seed=True)
        first, second = await asyncio.gather(collect(mesh.router_stub, sampled()),
                                             collect(mesh.router_stub, sampled()))
        assert first[0] == second[0] and len(first[0]) == 24
        # Proposals are sampled by the draft (= the target) and verified with its q: most
        # survive (tests/target/test_draft_probabilities.py compares with one-hot q).
        usage = first[2].usage
        assert usage.proposed_tokens >= usage.accepted_tokens > 0
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)


async def test_draft_killed_mid_stream_falls_back_without_changing_output(tiny_llama_dir, spans):
    draft = await start_draft(tiny_llama_dir)
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address, draft_timeout_s=0.3,
                            speculation={"speculation_method": "draft_model", "speculation_depth": 3})
    prompt = PROMPTS[1]
    try:
        call = mesh.router_stub.Generate(request(prompt, 120), metadata=(("authorization", "Bearer token-a"),))
        ids, killed, last = [], False, None
        async for response in call:
            ids.extend(response.chunk.token_ids)
            if len(ids) >= 10 and not killed:
                await draft.stop(grace=0)
                killed = True
            last = response.chunk
        assert killed
        assert ids == hf_greedy(tiny_llama_dir, prompt, 120)
        generate = [s for s in spans.get_finished_spans() if s.name == "target.generate"][-1]
        assert generate.attributes["specmesh.fallback_steps"] > 0
        assert last.usage.proposed_tokens > 0  # it did speculate before the kill
        assert any(s.name == "draft.propose" for s in spans.get_finished_spans())
        assert any(s.name == "verify" for s in spans.get_finished_spans())
    finally:
        await mesh.stop()


async def test_target_reconnects_when_the_draft_service_returns(tiny_llama_dir):
    from services.common.server import ServerConfig
    from services.draft.app import build_draft_server
    from services.draft.config import DraftConfig
    draft = await start_draft(tiny_llama_dir)
    port = draft.port
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address, draft_timeout_s=0.3,
                            speculation={"speculation_method": "prompt_lookup", "speculation_depth": 4})
    try:
        before = await collect(mesh.router_stub, request(PROMPTS[0], 16))
        assert before[2].usage.proposed_tokens > 0
        await draft.stop(grace=0)
        during = await collect(mesh.router_stub, request(PROMPTS[0], 16))
        assert during[0] == before[0]
        draft = build_draft_server(DraftConfig(server=ServerConfig(port=port)))  # same address, no state
        await draft.start()
        for _ in range(100):  # reconnects in the background within about a second
            if mesh.engine.speculator.client.connected:
                break
            await asyncio.sleep(0.05)
        after = await collect(mesh.router_stub, request(PROMPTS[0], 16))
        assert after[0] == before[0]
        assert after[2].usage.proposed_tokens > 0
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)


def test_rejection_sampler_with_a_fixed_seed_reproduces_exactly():
    import torch

    from services.target.kernels.select import get_kernels
    kernels = get_kernels("reference")
    vocab, nodes = 16, 4
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1, nodes, vocab, generator=gen), -1)
    tokens = torch.tensor([[0, 3, 5, 7]])
    parents = torch.tensor([[-1, 0, 1, 1]])  # a small tree: root -> 3 -> {5, 7}

    def run(seed):
        uniforms = torch.rand(1, nodes + 1, generator=torch.Generator().manual_seed(seed))
        out = kernels.accept_tree_sampling(tokens, parents, torch.tensor([nodes]), probs,
                                           torch.zeros_like(probs), uniforms)
        return [t.tolist() for t in out]
    assert run(123) == run(123)
    assert len({str(run(s)) for s in range(20)}) > 1  # and the seed matters


async def test_adaptive_policy_deepens_a_bucket_that_accepts_everything(tiny_llama_dir):
    from services.router.speculation_policy import acceptance_prior, best_depth_for

    draft = await start_draft(tiny_llama_dir)  # draft = target: every proposal is accepted
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address, speculation={
        "speculation_method": "draft_model", "speculation_depth": 2, "speculation_policy": "adaptive"})
    policy, bucket = mesh.router.service.policy, "chat-short-greedy"
    try:
        # Nothing measured: the depth predicted for open-ended chat (low acceptance) is 1.
        first_depth = best_depth_for(acceptance_prior(bucket, 0.0), policy.config)[0]
        assert policy.depth(bucket, 34, 0.0) == first_depth == 1
        first = await collect(mesh.router_stub, request(PROMPTS[3], 34))
        usage = first[2].usage
        assert usage.proposed_tokens >= 8 and usage.accepted_tokens == usage.proposed_tokens
        assert policy.acceptance(bucket) == pytest.approx(0.999)  # measured: everything accepted
        assert policy.depth(bucket, 34, 0.0) > first_depth  # the measurement outweighs the prior
        later = await collect(mesh.router_stub, request(PROMPTS[3], 34))
        assert later[0] == first[0] == hf_greedy(tiny_llama_dir, PROMPTS[3], 34)
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)


async def test_draft_restart_mid_stream_resends_history_and_output_is_unchanged(tiny_llama_dir):
    from services.common.server import ServerConfig
    from services.draft.app import build_draft_server
    from services.draft.config import DraftConfig
    draft = await start_draft(None)
    port = draft.port
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address, draft_timeout_s=0.3,
                            speculation={"speculation_method": "prompt_lookup", "speculation_depth": 4})
    client = mesh.engine.speculator.client
    try:
        call = mesh.router_stub.Generate(request(PROMPTS[0], 200),
                                         metadata=(("authorization", "Bearer token-a"),))
        ids, restarted = [], False
        async for response in call:
            ids.extend(response.chunk.token_ids)
            if len(ids) >= 20 and not restarted:
                await draft.stop(grace=0)
                draft = build_draft_server(DraftConfig(server=ServerConfig(port=port)))  # empty state
                await draft.start()
                restarted = True
        assert ids == hf_greedy(tiny_llama_dir, PROMPTS[0], 200)
        assert restarted
        for _ in range(100):
            if client.connected:
                break
            await asyncio.sleep(0.05)
        after = await collect(mesh.router_stub, request(PROMPTS[0], 16))
        assert after[0] == ids[:16] and after[2].usage.proposed_tokens > 0
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)
