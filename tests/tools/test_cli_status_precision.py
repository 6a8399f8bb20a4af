"""`specmesh status` shows each replica's host-tier KV precision (real target and router servers,
tiny Llama, fp32 pool): the `kv_cold_precision` setting, the policy it resolved to and why, and
the FP8 blocks and bytes the host tier holds, as GetStats reports them and the router's
ListModels carries them. GetStats also counts the restored entries' bytes as stored (FP8 ones
at their FP8 size), the numerator of the measured restore bandwidth."""

from __future__ import annotations

import asyncio

from services.router.replicas import replica_stats
from services.settings import read_settings
from services.status import status_lines
from services.target.engine.kv_precision import PoolLayout
from services.target.metrics import exported_gauges
from specmesh.proto.v1 import router_service_pb2, target_service_pb2
from tests.mesh import AUTH_A, TOKEN_A, collect, request, start_mesh
from tests.processes import free_port

POOL = dict(num_blocks=40, max_num_seqs=4, kv_host_bytes=1 << 24)  # block size 4: fillers evict a prompt
PROMPT = ("Chapter 1. The lighthouse keeper counted the ships that passed each night, one by one, "
          "and wrote their names in a book. ")
FILLERS = [f"Filler {i}: a list of unrelated words, apples, rivers, engines, clocks, {i} " * 2 for i in range(4)]


async def _status(mesh) -> list[str]:
    settings = read_settings({}, dev=True, router_address=mesh.router.address, token=TOKEN_A,
                             draft_address=f"127.0.0.1:{free_port()}", cache_address="")
    lines, _ = await asyncio.to_thread(status_lines, settings)  # blocking calls; the servers run here
    return lines


async def _precision_line(mesh, wanted) -> str:
    """The replica's precision line once the router's stats satisfy `wanted` (it polls each second)."""
    for _ in range(100):
        lines = await _status(mesh)
        replica = [i for i, line in enumerate(lines) if line.startswith(f"  replica {mesh.target.address}")]
        if replica and "(no stats yet)" not in lines[replica[0]] and wanted(lines[replica[0] + 1]):
            return lines[replica[0] + 1]
        await asyncio.sleep(0.2)
    raise AssertionError(f"the router never reported it: {lines}")


async def _replica_status(mesh) -> router_service_pb2.ReplicaStatus:
    models = await mesh.router_stub.ListModels(router_service_pb2.ListModelsRequest(), metadata=AUTH_A)
    return models.pools[0].replicas[0]


async def test_status_shows_the_default_policy_resolved_off_and_why(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, **POOL)  # kv_cold_precision "auto": nothing measured for it
    try:
        line = await _precision_line(mesh, lambda line: True)
        assert line == ("    cold KV precision auto -> off (no measured accuracy cost for this model and pool "
                        "dtype), host tier holds 0 FP8 blocks (0.0 MiB)")
        r = await _replica_status(mesh)
        assert (r.kv_cold_precision_setting, r.kv_cold_precision) == ("auto", "off")
        assert r.kv_cold_precision_reason == "auto: no measured accuracy cost for this model and pool dtype"
    finally:
        await mesh.stop()


async def test_status_shows_fp8_blocks_held_and_restore_bytes_count_them_at_their_size(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, **POOL, kv_cold_precision="fp8", kv_cold_after_tokens=8)
    try:
        spec = mesh.engine.spec
        layout = PoolLayout(spec.num_layers, 4, spec.num_kv_heads, spec.head_dim, mesh.engine.config.torch_kv_dtype)
        await collect(mesh.router_stub, request(PROMPT, 4))
        for filler in FILLERS:  # PROMPT's blocks go to the host tier, those past token 8 in FP8
            await collect(mesh.router_stub, request(filler, 4))
        target = mesh.target_stub()
        held = await target.GetStats(target_service_pb2.GetStatsRequest())
        assert held.host_tier_cold_blocks > 0 and held.host_tier_cold_bytes == held.host_tier_cold_blocks * \
            layout.cold_bytes
        assert (held.host_tier_cold_setting, held.host_tier_cold_precision) == ("fp8", "fp8")
        assert held.host_tier_cold_reason == "fp8 by setting"
        line = await _precision_line(mesh, lambda line: "holds 0 FP8" not in line)
        assert line == (f"    cold KV precision fp8 -> fp8 (fp8 by setting), host tier holds "
                        f"{held.host_tier_cold_blocks} FP8 blocks ({held.host_tier_cold_bytes / 2**20:.1f} MiB)")
        r = await _replica_status(mesh)
        assert (r.host_tier_fp8_blocks, r.host_tier_fp8_bytes) == (held.host_tier_cold_blocks,
                                                                   held.host_tier_cold_bytes)
        again = await collect(mesh.router_stub, request(PROMPT, 4))  # restored from the tier, FP8 ones decoded
        s = await target.GetStats(target_service_pb2.GetStatsRequest())
        assert again[2].usage.host_cached_prompt_tokens > 8 and s.host_tier_cold_restored_blocks > 0
        full = s.host_tier_restored_blocks - s.host_tier_cold_restored_blocks
        assert s.host_tier_restore_bytes == (full * mesh.engine.runner.kv_block_bytes
                                             + s.host_tier_cold_restored_blocks * layout.cold_bytes)
        assert s.host_tier_restore_bandwidth == s.host_tier_restore_bytes / s.host_tier_restore_seconds > 0
        assert s.kv_block_bytes == mesh.engine.runner.kv_block_bytes
        # The router prices this replica's host-tier hits at its stored bytes per block: less than a full
        # block while it holds FP8 copies.
        assert replica_stats(held).host_bytes_per_block < held.kv_block_bytes
        assert {"specmesh.kv.host.restore_bytes", "specmesh.kv.host.fp8_swapped_out"} <= set(exported_gauges())
    finally:
        await mesh.stop()
