"""The host tier below the KV pool, through real gRPC servers (tiny Llama, fp32): an evicted
prefix comes back from host memory instead of being recomputed, with the same greedy tokens;
bad entries fall back to recompute; the byte bound holds; tenants never share entries;
preempted sequences come back through the tier with the same tokens."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from specmesh.proto.v1 import target_service_pb2
from tests.e2e.test_generate import hf_greedy
from tests.mesh import AUTH_A, AUTH_B, collect, request, start_mesh

# Block size 4; 40 blocks hold 160 tokens: a few other prompts push a prompt's blocks out.
POOL = dict(num_blocks=40, max_num_seqs=4, kv_host_bytes=1 << 24)
PROMPT = "Chapter one. The lighthouse keeper counted the ships that passed each night, " * 2
FILLERS = [f"Filler {i}: a list of unrelated words, apples, rivers, engines, clocks, {i} " * 2 for i in range(4)]


async def _stats(mesh):
    return await mesh.target_stub().GetStats(target_service_pb2.GetStatsRequest())


async def _evict_everything(mesh):
    """Runs the fillers one by one: each takes most of the pool, evicting what was cached."""
    for filler in FILLERS:
        await collect(mesh.router_stub, request(filler, 4), metadata=AUTH_A)


async def test_an_evicted_prefix_is_restored_from_the_host_tier_with_the_same_greedy_tokens(tiny_llama_dir):
    expected = hf_greedy(tiny_llama_dir, PROMPT, 12)
    for host_bytes in (1 << 24, 0):  # with the tier, then without it (recompute)
        mesh = await start_mesh(tiny_llama_dir, **{**POOL, "kv_host_bytes": host_bytes})
        try:
            first = await collect(mesh.router_stub, request(PROMPT, 12))
            await _evict_everything(mesh)
            before = await _stats(mesh)
            again = await collect(mesh.router_stub, request(PROMPT, 12))
            after = await _stats(mesh)
            assert first[0] == again[0] == expected
            assert first[2].usage.cached_prompt_tokens == 0
            restored = after.host_tier_restored_tokens - before.host_tier_restored_tokens
            if host_bytes:
                assert before.evictions > 0 and before.host_tier_stored_blocks > 0
                assert again[2].usage.cached_prompt_tokens > 0
                assert restored == again[2].usage.cached_prompt_tokens  # all of it from the host tier
                assert again[2].usage.host_cached_prompt_tokens == restored  # final usage, by tier
                assert after.host_tier_restore_seconds > 0 and after.host_tier_store_seconds > 0
                assert after.host_tier_capacity_bytes == host_bytes
            else:
                assert again[2].usage.cached_prompt_tokens == 0 and restored == 0
                assert again[2].usage.host_cached_prompt_tokens == 0
                assert after.host_tier_stored_blocks == 0
            assert after.free_blocks == after.num_blocks
        finally:
            await mesh.stop()


async def test_fp8_kv_blocks_come_back_with_their_scales(tiny_gemma_dir):
    mesh = await start_mesh(tiny_gemma_dir, **POOL, kv_dtype="fp8")
    try:
        first = await collect(mesh.router_stub, request(PROMPT, 12))
        await _evict_everything(mesh)
        again = await collect(mesh.router_stub, request(PROMPT, 12))
        assert again[2].usage.host_cached_prompt_tokens > 0
        assert again[0] == first[0]  # the same FP8 values and scales as computed
    finally:
        await mesh.stop()


async def test_corrupted_truncated_and_foreign_entries_fall_back_to_recompute(tiny_llama_dir):
    from services.target.engine.host_tier import HostEntry
    expected = hf_greedy(tiny_llama_dir, PROMPT, 12)
    mesh = await start_mesh(tiny_llama_dir, **POOL)
    tier = mesh.engine.blocks.host_tier
    try:
        for damage in ("corrupt", "truncate", "foreign"):
            await collect(mesh.router_stub, request(PROMPT, 12))
            await _evict_everything(mesh)
            for h in tier.hashes():  # the engine is idle between requests: nothing else touches the tier
                entry = tier.entry_of(h)
                if damage == "corrupt":
                    entry.data[len(entry.data) // 2] ^= 0x10
                elif damage == "truncate":
                    entry.data = entry.data[:-8]
                else:  # another model's block under the same key (as a shared store could hold)
                    other = replace(tier.identity, model_id="other-model")
                    tier.put(h, HostEntry.build(entry.key, entry.data.clone(), other))
            before = await _stats(mesh)
            again = await collect(mesh.router_stub, request(PROMPT, 12))
            after = await _stats(mesh)
            assert again[0] == expected, damage
            assert again[2].usage.cached_prompt_tokens == 0, damage  # every entry was bad: all recomputed
            assert after.host_tier_rejected_blocks > before.host_tier_rejected_blocks, damage
            assert after.host_tier_restored_blocks == before.host_tier_restored_blocks, damage
    finally:
        await mesh.stop()


async def test_a_host_hit_is_recomputed_while_restoring_is_measured_dearer(tiny_llama_dir):
    expected = hf_greedy(tiny_llama_dir, PROMPT, 12)
    mesh = await start_mesh(tiny_llama_dir, **POOL)
    tier = mesh.engine.blocks.host_tier
    try:
        await collect(mesh.router_stub, request(PROMPT, 12))
        await _evict_everything(mesh)
        await collect(mesh.router_stub, request(FILLERS[0], 4))  # restored: its restore cost is measured
        assert (await _stats(mesh)).host_tier_restored_blocks > 0 and tier.restore_pays()
        tier.add_time(restore_s=1e6)  # as if restoring had been slow: dearer than any recompute
        assert not tier.restore_pays()
        before = await _stats(mesh)
        again = await collect(mesh.router_stub, request(PROMPT, 12))
        after = await _stats(mesh)
        assert again[0] == expected
        assert again[2].usage.host_cached_prompt_tokens == 0  # recomputed, though the tier holds it
        assert after.host_tier_restored_blocks == before.host_tier_restored_blocks
    finally:
        await mesh.stop()


async def test_the_byte_bound_holds_under_a_load_that_overflows_the_tier(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, **POOL)
    block_bytes = mesh.engine.runner.kv_block_bytes
    await mesh.stop()
    bound = 10 * block_bytes + block_bytes // 2  # ten blocks and a half: the half never fits
    mesh = await start_mesh(tiny_llama_dir, **{**POOL, "kv_host_bytes": bound})
    try:
        prompts = [f"Conversation {i}: tell me about the weather in town number {i} today " * 2 for i in range(12)]
        seen = 0
        for batch in (prompts[:4], prompts[4:8], prompts[8:]):
            await asyncio.gather(*(collect(mesh.router_stub, request(p, 6)) for p in batch))
            stats = await _stats(mesh)
            assert stats.host_tier_bytes <= bound and stats.host_tier_blocks <= 10
            seen = max(seen, stats.host_tier_blocks)
        assert stats.host_tier_stored_blocks > 10 and stats.host_tier_dropped_blocks > 0  # it overflowed
        assert seen == 10 and stats.host_tier_bytes == 10 * block_bytes
    finally:
        await mesh.stop()


async def test_entries_are_never_served_across_tenants(tiny_llama_dir):
    expected = hf_greedy(tiny_llama_dir, PROMPT, 12)
    mesh = await start_mesh(tiny_llama_dir, **POOL)
    try:
        await collect(mesh.router_stub, request(PROMPT, 12), metadata=AUTH_A)
        await _evict_everything(mesh)
        before = await _stats(mesh)
        assert before.host_tier_blocks > 0
        other = await collect(mesh.router_stub, request(PROMPT, 12), metadata=AUTH_B)
        after = await _stats(mesh)
        assert other[0] == expected
        assert other[2].usage.cached_prompt_tokens == 0  # tenant B: no hit on tenant A's entries
        assert after.host_tier_restored_blocks == before.host_tier_restored_blocks
        assert after.host_tier_rejected_blocks == before.host_tier_rejected_blocks  # not even looked at
        mine = await collect(mesh.router_stub, request(PROMPT, 12), metadata=AUTH_A)
        assert mine[0] == expected and mine[2].usage.cached_prompt_tokens > 0
        assert mine[2].usage.host_cached_prompt_tokens == mine[2].usage.cached_prompt_tokens
    finally:
        await mesh.stop()


async def test_preempted_sequences_come_back_through_the_host_tier_with_the_same_tokens(tiny_llama_dir):
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    expected = [hf_greedy(tiny_llama_dir, p, 40) for p in prompts]
    # 6 sequences of ~60 tokens need ~90 blocks of 4; 40 blocks force preemption. A sequence
    # preempted by recompute (not swapped: tests/target/test_kv_swap_serving.py) has its committed
    # full blocks cached: evicted to the host tier, restored on its return.
    mesh = await start_mesh(tiny_llama_dir, num_blocks=40, kv_host_bytes=1 << 24, preemption_mode="recompute")
    try:
        results = await asyncio.gather(*(collect(mesh.router_stub, request(p, 40)) for p in prompts))
        assert [r[0] for r in results] == expected
        stats = await _stats(mesh)
        assert stats.preemptions > 0 and stats.host_tier_restored_blocks > 0
        assert stats.free_blocks == stats.num_blocks
    finally:
        await mesh.stop()
