"""Swap on preemption through real gRPC servers (tiny Llama, fp32, a 40-block pool that forces
preemption): swapped sequences return the same greedy tokens as recomputed ones and as Hugging
Face, with prefix caching on and off; "auto" swaps only while the copies are measured cheaper
and the host tier has room; GetStats and /metrics count swapped and recomputed preemptions."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.telemetry import serve_metrics
from specmesh.proto.v1 import target_service_pb2
from tests.e2e.test_generate import hf_greedy
from tests.mesh import collect, request, start_mesh

# 6 sequences of ~50 tokens need ~75 blocks of 4; 40 blocks force preemption mid-decode.
PROMPTS = [f"Story number {i}: once upon a time" for i in range(6)]
MAX_TOKENS = 40
POOL = dict(num_blocks=40, max_num_seqs=6)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return [hf_greedy(tiny_llama_dir, p, MAX_TOKENS) for p in PROMPTS]


async def _stats(mesh):
    return await mesh.target_stub().GetStats(target_service_pb2.GetStatsRequest())


def _watch_preemptions(mesh) -> list[dict]:
    """Records each preemption as the scheduler makes it (on the engine thread): the victim's
    computed, prompt and total tokens, what the tier's measurements said, and whether it swapped."""
    scheduler, tier, seen = mesh.engine.scheduler, mesh.engine.blocks.host_tier, []
    preempt = scheduler._preempt

    def watched(seq):
        computed, swaps = seq.num_computed, scheduler.num_swap_preemptions
        blocks = -(-computed // mesh.engine.blocks.block_size)
        pays = tier.swap_pays(blocks, computed) if tier is not None else False
        preempt(seq)
        seen.append(dict(computed=computed, prompt=seq.num_prompt_tokens, pays=pays,
                         swapped=scheduler.num_swap_preemptions > swaps))
    scheduler._preempt = watched
    return seen


async def _generate_all(mesh) -> list[list[int]]:
    results = await asyncio.gather(*(collect(mesh.router_stub, request(p, MAX_TOKENS)) for p in PROMPTS))
    return [r[0] for r in results]


def _scrape(port: int, name: str, engine: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and s.labels.get("specmesh_engine") == engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
async def test_swap_preemption_returns_the_same_greedy_tokens_as_recompute_preemption(
        tiny_llama_dir, expected, prefix_caching):
    port = serve_metrics("target", "127.0.0.1", 0)
    outputs, stats, computed = {}, {}, {}
    for mode in ("swap", "recompute"):
        mesh = await start_mesh(tiny_llama_dir, **POOL, enable_prefix_caching=prefix_caching, preemption_mode=mode)
        seen = _watch_preemptions(mesh)
        try:
            outputs[mode] = await _generate_all(mesh)
            stats[mode] = s = await _stats(mesh)
            computed[mode] = mesh.engine.stats().prompt_tokens_computed
            swapped_metric = await asyncio.to_thread(_scrape, port, "specmesh_preemptions_swapped_total",
                                                     mesh.engine.instance_id)
            recomputed_metric = await asyncio.to_thread(_scrape, port, "specmesh_preemptions_recomputed_total",
                                                        mesh.engine.instance_id)
        finally:
            await mesh.stop()
        assert s.preemptions > 0 and s.swap_preemptions + s.recompute_preemptions == s.preemptions
        assert (swapped_metric, recomputed_metric) == (s.swap_preemptions, s.recompute_preemptions)
        assert s.free_blocks == s.num_blocks and s.host_tier_swap_bytes == 0
        if mode == "swap":
            assert s.swap_preemptions == s.preemptions and all(p["swapped"] for p in seen)
            # A sequence swapped mid-decode with a partial last block: its KV came back whole.
            assert any(p["computed"] > p["prompt"] and p["computed"] % 4 for p in seen), seen
            assert s.host_tier_swapped_in_blocks == s.host_tier_swapped_out_blocks > 0
            assert s.host_tier_swap_out_seconds > 0 and s.swap_seconds_per_block > 0
        else:
            assert s.swap_preemptions == 0 and s.host_tier_swapped_out_blocks == 0
    assert outputs["swap"] == outputs["recompute"] == expected
    if not prefix_caching:  # swapped sequences resumed where they were, recomputed ones from their first token
        prompt_tokens = sum(len(ids) for ids in mesh.engine.tokenizer(PROMPTS).input_ids)
        assert computed["swap"] == prompt_tokens < computed["recompute"]


async def test_auto_swaps_only_while_the_copies_are_measured_cheaper_than_recomputing(tiny_llama_dir, expected):
    mesh = await start_mesh(tiny_llama_dir, **POOL)  # preemption_mode "auto"
    tier, scheduler = mesh.engine.blocks.host_tier, mesh.engine.scheduler
    seen = _watch_preemptions(mesh)
    try:
        assert scheduler.preemption_mode == "auto"
        assert await _generate_all(mesh) == expected
        first = await _stats(mesh)
        # Each decision followed the measurements of its moment (True while one side was unmeasured).
        assert seen and all(p["swapped"] == p["pays"] for p in seen), seen
        assert first.swap_preemptions == sum(p["swapped"] for p in seen)
        if not first.swap_preemptions:  # measured dearer all along on this machine: measure a swap
            scheduler.preemption_mode = "swap"
            assert await _generate_all(mesh) == expected
            scheduler.preemption_mode = "auto"
        assert tier.swap_s_per_block > 0 and tier.recompute_s_per_block > 0
        tier.add_swap_time(out_s=1e6)  # as if the copies had been slow: dearer than any recompute
        assert not tier.swap_pays(1, 4)
        before = await _stats(mesh)
        seen.clear()
        assert await _generate_all(mesh) == expected
        after = await _stats(mesh)
        assert seen and not any(p["swapped"] for p in seen)
        assert after.swap_preemptions == before.swap_preemptions
        assert after.recompute_preemptions - before.recompute_preemptions == len(seen)
        # Recomputed with prefix caching on: their full blocks came back through the pool or the tier.
        assert after.host_tier_restored_blocks > before.host_tier_restored_blocks
    finally:
        await mesh.stop()


async def test_without_room_in_the_host_tier_preempted_sequences_are_recomputed(tiny_llama_dir, expected):
    probe = await start_mesh(tiny_llama_dir, **POOL)
    block_bytes = probe.engine.runner.kv_block_bytes
    await probe.stop()
    # Room for one block: every victim holds more (a prompt of ~10 tokens and what it decoded).
    mesh = await start_mesh(tiny_llama_dir, **POOL, kv_host_bytes=block_bytes, preemption_mode="swap")
    seen = _watch_preemptions(mesh)
    try:
        assert await _generate_all(mesh) == expected
        s = await _stats(mesh)
        assert s.preemptions > 0 and s.recompute_preemptions == s.preemptions and s.swap_preemptions == 0
        assert not any(p["swapped"] for p in seen)
        assert s.host_tier_bytes <= block_bytes and s.host_tier_swap_bytes == 0
    finally:
        await mesh.stop()
