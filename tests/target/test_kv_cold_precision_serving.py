"""Cold precision of the host tier through real gRPC servers (tiny Llama, fp32 pool): off by
default (a model nothing was measured for), and with `kv_cold_precision fp8` evicted prefix
blocks past the length threshold are held in FP8, smaller, and restored dequantized; the byte
bound holds over FP8 entries. (How close restored FP8 KV keeps the model to recompute is measured
teacher-forced in tests/target/test_kv_precision.py: free-running greedy tokens part for good at the
first flipped choice, so position-by-position agreement of free-running output says little.)"""

from __future__ import annotations

import asyncio

from specmesh.proto.v1 import target_service_pb2
from services.target.engine.kv_precision import COLD, PoolLayout
from tests.e2e.test_generate import hf_greedy
from tests.mesh import AUTH_A, collect, request, start_mesh

# Block size 4; 40 blocks hold 160 tokens: a few other prompts push a prompt's blocks out.
POOL = dict(num_blocks=40, max_num_seqs=4, kv_host_bytes=1 << 24)
PROMPTS = [f"Chapter {i}. The lighthouse keeper counted the ships that passed each night, one by one, "
           f"and wrote their names in book number {i}. " for i in range(4)]
FILLERS = [f"Filler {i}: a list of unrelated words, apples, rivers, engines, clocks, {i} " * 2 for i in range(4)]
TOKENS = 24


async def _stats(mesh):
    return await mesh.target_stub().GetStats(target_service_pb2.GetStatsRequest())


async def _evict_everything(mesh):
    for filler in FILLERS:
        await collect(mesh.router_stub, request(filler, 4), metadata=AUTH_A)


def _layout(mesh) -> PoolLayout:
    spec, blocks = mesh.engine.spec, mesh.engine.blocks
    return PoolLayout(spec.num_layers, blocks.block_size, spec.num_kv_heads, spec.head_dim,
                      mesh.engine.config.torch_kv_dtype)


async def test_off_by_default_for_a_model_without_a_measured_cost(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, **POOL)  # kv_cold_precision "auto"
    try:
        assert mesh.engine.config.kv_cold_precision == "auto"
        await collect(mesh.router_stub, request(PROMPTS[0], 8))
        await _evict_everything(mesh)
        again = await collect(mesh.router_stub, request(PROMPTS[0], 8))
        stats = await _stats(mesh)
        assert stats.host_tier_cold_precision == "off"
        assert stats.host_tier_stored_blocks > 0 and stats.host_tier_cold_stored_blocks == 0
        assert stats.host_tier_cold_blocks == stats.host_tier_cold_bytes == 0
        assert again[2].usage.host_cached_prompt_tokens > 0 and stats.host_tier_cold_restored_blocks == 0
        assert again[0] == hf_greedy(tiny_llama_dir, PROMPTS[0], 8)  # restores stay byte-exact
    finally:
        await mesh.stop()


async def test_fp8_copies_are_smaller_and_restored_dequantized(tiny_llama_dir):
    after = 8  # the first two blocks of each prefix stay in full precision
    mesh = await start_mesh(tiny_llama_dir, **POOL, kv_cold_precision="fp8", kv_cold_after_tokens=after)
    try:
        layout = _layout(mesh)
        block_bytes = mesh.engine.runner.kv_block_bytes
        assert layout.full_bytes == block_bytes and layout.cold_bytes < block_bytes / 3
        common = []
        for prompt in PROMPTS:
            expected = hf_greedy(tiny_llama_dir, prompt, TOKENS)  # recompute (fp32, no tier)
            first = await collect(mesh.router_stub, request(prompt, TOKENS))
            assert first[0] == expected
            await _evict_everything(mesh)
            tier = mesh.engine.blocks.host_tier
            held = {tier.entry_of(h).key: tier.entry_of(h) for h in tier.hashes()}
            # As if recomputing were slow: this test is about what FP8 copies hold, not the
            # measured restore-or-recompute choice (test_kv_host_tier_serving.py tests that), which
            # on a tiny fp32 model may find decoding FP8 dearer than recomputing and skip the tier.
            tier.observe_recompute(seconds=1.0, num_tokens=1)
            before = await _stats(mesh)
            again = await collect(mesh.router_stub, request(prompt, TOKENS))
            after_stats = await _stats(mesh)
            restored = after_stats.host_tier_cold_restored_blocks - before.host_tier_cold_restored_blocks
            assert again[2].usage.host_cached_prompt_tokens > 2 * after and restored > 0
            assert len(again[0]) == TOKENS
            common.append(next((i for i, (a, b) in enumerate(zip(again[0], first[0])) if a != b), TOKENS))
            assert any(e.precision == COLD for e in held.values())
        stats = await _stats(mesh)
        assert stats.host_tier_cold_precision == "fp8"
        assert 0 < stats.host_tier_cold_stored_blocks < stats.host_tier_stored_blocks  # first blocks exact
        cold_held = [tier.entry_of(h) for h in tier.hashes() if tier.entry_of(h).precision == COLD]
        assert cold_held and all(e.num_bytes == layout.cold_bytes for e in cold_held)
        assert stats.host_tier_cold_bytes == len(cold_held) * layout.cold_bytes
        # Restored FP8 KV is not the computed KV: on this tiny random model (flat logits) the greedy
        # tokens part from recompute after a few tokens (shown with -s; not asserted, see the docstring).
        print(f"greedy tokens after an FP8 restore equal to recompute before they part: {common} of {TOKENS}")
    finally:
        await mesh.stop()


async def test_the_byte_bound_holds_over_fp8_entries_and_holds_more_blocks(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, **POOL, kv_cold_precision="fp8", kv_cold_after_tokens=0)
    cold_bytes, full_bytes = _layout(mesh).cold_bytes, mesh.engine.runner.kv_block_bytes
    await mesh.stop()
    bound = 4 * full_bytes + cold_bytes // 2  # four full blocks: a dozen FP8 ones
    mesh = await start_mesh(tiny_llama_dir, **{**POOL, "kv_host_bytes": bound}, kv_cold_precision="fp8",
                            kv_cold_after_tokens=0)
    try:
        prompts = [f"Conversation {i}: tell me about the weather in town number {i} today " * 2 for i in range(12)]
        most = 0
        for batch in (prompts[:4], prompts[4:8], prompts[8:]):
            await asyncio.gather(*(collect(mesh.router_stub, request(p, 6)) for p in batch))
            stats = await _stats(mesh)
            assert stats.host_tier_bytes <= bound
            assert stats.host_tier_cold_blocks == stats.host_tier_blocks  # every block past token 0
            most = max(most, stats.host_tier_blocks)
        assert stats.host_tier_dropped_blocks > 0  # it overflowed
        assert most == bound // cold_bytes > 4 * full_bytes // full_bytes
    finally:
        await mesh.stop()
