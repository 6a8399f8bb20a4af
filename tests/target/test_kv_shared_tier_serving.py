"""The shared tier through real gRPC servers and a real Redis (tiny Llama, fp32): two replicas
share it, so a prefix computed on one is loaded by the other with the same greedy tokens; bad,
foreign and other-tenant entries fall back to recompute; Redis down (or stopped mid-run) loses
no request; this replica's byte bound holds under a load that overflows it."""

from __future__ import annotations

import asyncio
import json
import struct

import redis
import torch

from specmesh.proto.v1 import router_service_pb2, target_service_pb2
from services.status import replica_line
from services.target.engine.shared_tier import MAGIC
from tests.e2e.test_generate import hf_greedy
from tests.mesh import AUTH_A, AUTH_B, collect, request, start_mesh
from tests.target.shared_redis import URL, PrivateRedis, free_port, kv_prefix  # noqa: F401 (fixture)

PROMPT = "Chapter one. The lighthouse keeper counted the ships that passed each night, " * 2


def _shared(prefix: str, url: str = URL, **kw) -> dict:
    return dict(kv_host_bytes=1 << 24, kv_shared_url=url, kv_shared_prefix=prefix, kv_shared_timeout_ms=200, **kw)


async def _stats(mesh):
    return await mesh.target_stub().GetStats(target_service_pb2.GetStatsRequest())


async def _router_view(mesh, restored_blocks: int):
    """The router's view of the mesh's replica once its stats show `restored_blocks` shared-tier loads."""
    for _ in range(100):
        pools = (await mesh.router_stub.ListModels(router_service_pb2.ListModelsRequest(), metadata=AUTH_A)).pools
        replica = pools[0].replicas[0]
        if replica.shared_tier_restored_blocks == restored_blocks:
            return replica
        await asyncio.sleep(0.05)
    raise AssertionError(f"the router never saw {restored_blocks} restored blocks: {replica}")


async def _pair(model_dir, prefix, **kw):
    return await start_mesh(model_dir, **_shared(prefix, **kw)), await start_mesh(model_dir, **_shared(prefix, **kw))


async def test_a_prefix_computed_on_one_replica_is_loaded_by_another(tiny_llama_dir, kv_prefix):
    expected = hf_greedy(tiny_llama_dir, PROMPT, 12)
    a, b = await _pair(tiny_llama_dir, kv_prefix)
    try:
        first = await collect(a.router_stub, request(PROMPT, 12))
        assert a.engine.blocks.shared_tier.flush()
        written = (await _stats(a)).shared_tier_written_blocks
        assert written > 0 and first[2].usage.cached_prompt_tokens == 0
        again = await collect(b.router_stub, request(PROMPT, 12))
        usage, stats = again[2].usage, await _stats(b)
        assert again[0] == first[0] == expected
        assert usage.shared_cached_prompt_tokens > 0 and usage.host_cached_prompt_tokens == 0
        assert usage.cached_prompt_tokens == usage.shared_cached_prompt_tokens  # all of it from A's entries
        assert stats.shared_tier_restored_tokens == usage.shared_cached_prompt_tokens
        assert stats.shared_tier_loaded_blocks == stats.shared_tier_restored_blocks > 0
        assert stats.shared_tier_load_seconds > 0 and stats.shared_tier_rejected_blocks == 0
        assert stats.host_tier_restored_blocks == 0  # counted by tier: none of them evicted here
        assert b.engine.stats().prompt_tokens_computed == usage.prompt_tokens - usage.cached_prompt_tokens
        replica = await _router_view(b, stats.shared_tier_restored_blocks)  # what `specmesh status` prints
        assert replica.shared_tier_capacity_bytes == 1 << 30
        assert f"shared tier 0.0/1024.0 MiB written, {stats.shared_tier_restored_blocks} blocks loaded" \
            in replica_line(replica)
        assert b.engine.blocks.shared_tier.flush()
        assert (await _stats(b)).shared_tier_written_blocks == 0  # all B committed, A had written: not again
    finally:
        await a.stop()
        await b.stop()


def _damage(prefix: str, how: str) -> int:
    """Rewrites every entry under `prefix` as `how` says; returns how many."""
    client = redis.Redis.from_url(URL)
    keys = list(client.scan_iter(f"{prefix}:*"))
    for key in keys:
        value = bytearray(client.get(key))
        if how == "corrupt":
            value[-7] ^= 0x20
        elif how == "truncate":
            value = value[:-12]
        else:  # another model's entry under this key: intact, but its header names that model
            (size,) = struct.unpack_from("<I", value, len(MAGIC))
            header = json.loads(value[len(MAGIC) + 4:len(MAGIC) + 4 + size])
            header = json.dumps({**header, "model": "other-model"}).encode()
            value = MAGIC + struct.pack("<I", len(header)) + header + value[len(MAGIC) + 4 + size:]
        client.set(key, bytes(value), keepttl=True)
    client.close()
    return len(keys)


async def test_bad_foreign_and_other_tenant_entries_fall_back_to_recompute(tiny_llama_dir, kv_prefix):
    a, b = await _pair(tiny_llama_dir, kv_prefix)
    try:
        for how in ("corrupt", "truncate", "foreign", "tenant"):
            prompt = f"({how}) {PROMPT}"  # differs from the first block on: nothing held from before
            expected = hf_greedy(tiny_llama_dir, prompt, 12)
            await collect(a.router_stub, request(prompt, 12))
            assert a.engine.blocks.shared_tier.flush()
            if how != "tenant":
                assert _damage(kv_prefix, how) > 0
            before = await _stats(b)
            again = await collect(b.router_stub, request(prompt, 12), metadata=AUTH_B if how == "tenant" else AUTH_A)
            after = await _stats(b)
            assert again[0] == expected, how
            assert again[2].usage.cached_prompt_tokens == 0, how  # every entry refused: all recomputed
            assert after.shared_tier_restored_blocks == before.shared_tier_restored_blocks, how
            rejected = after.shared_tier_rejected_blocks - before.shared_tier_rejected_blocks
            assert rejected == (0 if how == "tenant" else 1), how  # tenant B's hashes differ: not even found
    finally:
        await a.stop()
        await b.stop()


async def test_redis_down_loses_no_request(tiny_llama_dir, kv_prefix):
    expected = hf_greedy(tiny_llama_dir, PROMPT, 12)
    mesh = await start_mesh(tiny_llama_dir, **_shared(kv_prefix, url=f"redis://127.0.0.1:{free_port()}/0"))
    try:
        results = await asyncio.gather(*(collect(mesh.router_stub, request(PROMPT, 12)) for _ in range(3)))
        assert [r[0] for r in results] == [expected] * 3
        stats = await _stats(mesh)
        assert stats.shared_tier_errors > 0 and stats.shared_tier_written_blocks == 0
    finally:
        await mesh.stop()


async def test_a_redis_stopped_mid_run_loses_no_request(tiny_llama_dir, kv_prefix):
    server = PrivateRedis()  # our own: the shared one on 6379 is never stopped
    prompts = [f"{PROMPT} Night {i}." for i in range(6)]
    expected = [hf_greedy(tiny_llama_dir, p, 16) for p in prompts]
    a, b = await _pair(tiny_llama_dir, kv_prefix, url=server.url)
    try:
        await asyncio.gather(*(collect(a.router_stub, request(p, 16)) for p in prompts))
        assert a.engine.blocks.shared_tier.flush()
        running = [asyncio.ensure_future(collect(b.router_stub, request(p, 16))) for p in prompts]
        await asyncio.sleep(0.05)
        server.stop()  # while B loads and runs them
        results = await asyncio.gather(*running)
        assert [r[0] for r in results] == expected
        after = await collect(b.router_stub, request(prompts[0] + " Again.", 4))  # Redis gone: recompute
        assert after[2].finish_reason and (await _stats(b)).shared_tier_errors > 0
    finally:
        server.stop()
        await a.stop()
        await b.stop()


async def test_the_byte_bound_holds_under_a_load_that_overflows_it(tiny_llama_dir, kv_prefix):
    mesh = await start_mesh(tiny_llama_dir, **_shared(kv_prefix))
    tier = mesh.engine.blocks.shared_tier
    entry_bytes = len(tier.frame((None, (0, 0, 0, 0), ""), torch.zeros(mesh.engine.runner.kv_block_bytes,
                                                                       dtype=torch.uint8)))
    await mesh.stop()
    bound = 10 * entry_bytes + entry_bytes // 2  # ten entries and a half: the half never fits
    mesh = await start_mesh(tiny_llama_dir, **_shared(kv_prefix, kv_shared_bytes=bound))
    client = redis.Redis.from_url(URL)
    try:
        prompts = [f"Conversation {i}: tell me about the weather in town number {i} today " * 2 for i in range(8)]
        for batch in (prompts[:4], prompts[4:]):
            await asyncio.gather(*(collect(mesh.router_stub, request(p, 6)) for p in batch))
            assert mesh.engine.blocks.shared_tier.flush()
            held = sum(client.strlen(k) for k in client.scan_iter(f"{kv_prefix}:*"))
            stats = await _stats(mesh)
            assert held <= bound and stats.shared_tier_bytes == held
        assert stats.shared_tier_written_blocks > 10 and stats.shared_tier_deleted_blocks > 0  # it overflowed
        assert held == 10 * entry_bytes and stats.shared_tier_capacity_bytes == bound
    finally:
        client.close()
        await mesh.stop()
