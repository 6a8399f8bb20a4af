"""The speculation method per pool and bucket, through real servers (router, tiny target, a
draft service with prompt lookup, suffix decoding and a feature head trained in the test).

Shown: a configured mapping runs prompt lookup for a copy-heavy bucket and the feature head for
open text, and the route record and the router's routes metric say which method ran; with
several candidates the router measures each through its real feedback path (the final usage)
and settles per bucket on the one that accepted most, even where the priors and the mapping's
order say otherwise; greedy output is token-identical to speculation off whatever ran.
"""

from __future__ import annotations

import asyncio

import pytest

from services.common.metrics import method_name
from services.common.server import GrpcServer, ServerConfig
from services.draft.config import DraftConfig
from services.draft.eagle.proposer import EagleProposer
from services.draft.service import SERVICE_NAME, DraftService, add_to_server
from services.router import route_metrics
from services.router.speculation_policy import PolicyConfig, SpeculationPolicy
from tests.eagle_head import train_tiny_head
from tests.mesh import collect, request, start_mesh

# Distinct copy-style prompts (bucket rewrite-short-greedy) the head is trained on, and one
# open-text prompt (chat-short-greedy) it never saw, asked again and again: there suffix
# decoding finds the earlier answers in the tenant's outputs and the head drafts little.
REWRITE = [f"Rewrite: {a} {b}" for a in ("the ship", "a letter", "my garden", "this song")
           for b in ("sails north", "is late", "grows")]
CHAT = "Tell me a story about the sea"
MAX_TOKENS = 32
THREE = "prompt_lookup|suffix|eagle"


@pytest.fixture(scope="module")
def head_path(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("method-per-bucket")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(REWRITE * 6) + "\n")
    return train_tiny_head(tiny_llama_dir, root / "head.safetensors", prompts_file=prompts,
                           num_prompts=len(REWRITE) * 6, max_new_tokens=MAX_TOKENS, epochs=8, batch_size=8,
                           sampled_share=0.3).path  # seconds


async def _draft(model_dir, head_path) -> GrpcServer:
    config = DraftConfig(server=ServerConfig(port=0), draft_model_dtype="float32")
    service = DraftService(config, eagle=EagleProposer.load(head_path, model_dir))
    draft = GrpcServer(config.server, lambda server: add_to_server(server, service), [SERVICE_NAME],
                       on_drain=service.drain)
    await draft.start()
    return draft


async def _outputs_alone(model_dir, prompts) -> dict[str, list[int]]:
    mesh = await start_mesh(model_dir)  # speculation off
    try:
        return {p: (await collect(mesh.router_stub, request(p, MAX_TOKENS)))[0] for p in dict.fromkeys(prompts)}
    finally:
        await mesh.stop()


async def _run(model_dir, head_path, methods: str, prompts: list[str]):
    """[(prompt, token ids, final response)] in order, through a router planning `auto` with
    `methods` at a fixed depth 4 (the fixed policy still chooses the method), and the router's policy."""
    draft = await _draft(model_dir, head_path)
    mesh = await start_mesh(model_dir, speculation={"speculation_method": "auto", "speculation_methods": methods,
                                                    "speculation_depth": 4},
                            draft_address=draft.address, max_batched_tokens=256)
    try:
        out = []
        for prompt in prompts:
            ids, last = [], None
            async for response in mesh.router_stub.Generate(request(prompt, MAX_TOKENS),
                                                            metadata=(("authorization", "Bearer token-a"),)):
                ids.extend(response.chunk.token_ids)
                last = response
            out.append((prompt, ids, last))
        return out, mesh.router.service.policy
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)


def _method(response) -> str:
    return method_name(response.route.speculation.method)


def test_a_configured_mapping_runs_its_method_per_bucket_and_says_so(tiny_llama_dir, head_path):
    prompts = [REWRITE[0], CHAT, REWRITE[1], CHAT]
    before = {(b, m): route_metrics.count(route_metrics.ROUTES, **{"specmesh.bucket": b,
                                                                  "specmesh.speculation.method": m})
              for b, m in (("rewrite-short-greedy", "prompt_lookup"), ("chat-short-greedy", "eagle"))}
    runs, _ = asyncio.run(_run(tiny_llama_dir, head_path,
                               "rewrite-*=prompt_lookup, default:chat-*=eagle", prompts))
    alone = asyncio.run(_outputs_alone(tiny_llama_dir, prompts))
    for prompt, ids, last in runs:
        expected = ("rewrite-short-greedy", "prompt_lookup") if prompt.startswith("Rewrite") else \
            ("chat-short-greedy", "eagle")
        assert (last.route.bucket, _method(last)) == expected
        assert last.route.speculation.max_depth == 4
        assert ids == alone[prompt]  # greedy: token-identical to speculation off
    eagle_usage = [last.chunk.usage for prompt, _, last in runs if prompt == CHAT]
    assert all(u.proposed_tokens > 0 and u.fallback_steps == 0 for u in eagle_usage)  # the head drafted
    for (bucket, method), count in before.items():
        assert route_metrics.count(route_metrics.ROUTES, **{"specmesh.bucket": bucket,
                                                            "specmesh.speculation.method": method}) == count + 2


def test_measured_acceptance_picks_the_better_method_per_bucket(tiny_llama_dir, head_path):
    methods = f"chat-*={THREE},rewrite-*={THREE}"
    # Rounds of one rewrite and one chat request; the rewrite prompts twice over (suffix decoding
    # runs no rewrite request once its three looks are done, so it learns none of their answers).
    prompts = [p for rewrite in REWRITE * 2 for p in (rewrite, CHAT)]
    runs, policy = asyncio.run(_run(tiny_llama_dir, head_path, methods, prompts))
    measured = {bucket: {m: policy.acceptance(bucket, m) for m in THREE.split("|")}
                for bucket in ("chat-short-greedy", "rewrite-short-greedy")}
    print(f"measured acceptance: {measured}")
    for bucket, by_method in measured.items():
        assert all(a is not None for a in by_method.values()), bucket  # every candidate was tried
    best = {bucket: max(by_method, key=by_method.get) for bucket, by_method in measured.items()}
    assert best == {"chat-short-greedy": "suffix", "rewrite-short-greedy": "eagle"}
    # Settled (every candidate measured explore_samples times): the last rounds run the best
    # measured method in both buckets.
    assert [_method(last) for _, _, last in runs[-8:]] == ["eagle", "suffix"] * 4
    # The priors (and the mapping's order) alone would have chosen otherwise.
    fresh = SpeculationPolicy(PolicyConfig(mode="fixed"), 4, methods=policy.methods)
    assert fresh.choose("chat-short-greedy", MAX_TOKENS, 0.0).method == "eagle"
    assert fresh.choose("rewrite-short-greedy", MAX_TOKENS, 0.0).method == "prompt_lookup"
    # Whatever ran, greedy output is the target's alone.
    alone = asyncio.run(_outputs_alone(tiny_llama_dir, prompts))
    assert all(ids == alone[prompt] for prompt, ids, _ in runs)
    assert {_method(last) for prompt, _, last in runs if prompt == CHAT} == set(THREE.split("|"))
