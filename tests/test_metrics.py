"""The engine's OpenTelemetry metrics are exported with the values GetStats reports."""

from __future__ import annotations

from services.common.proto.specmesh.v1 import target_service_pb2
from tests.mesh import collect, request, start_mesh


def _points(reader) -> dict[str, list]:
    out: dict[str, list] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


async def test_kv_queue_and_latency_metrics_are_exported(tiny_llama_dir, metric_reader):
    mesh = await start_mesh(tiny_llama_dir, num_blocks=64)
    try:
        prompt = "System: answer briefly. " * 4
        await collect(mesh.router_stub, request(prompt + "one", 8))
        await collect(mesh.router_stub, request(prompt + "two", 8))
        stats = await mesh.target_stub().GetStats(target_service_pb2.GetStatsRequest())
        points = _points(metric_reader)
        mine = lambda name: [p for p in points[name]  # noqa: E731
                             if p.attributes.get("specmesh.engine") == mesh.engine.instance_id]
        assert mine("specmesh.kv.bytes")[-1].value == stats.kv_bytes > 0
        assert mine("specmesh.kv.blocks.cached")[-1].value == stats.cached_blocks > 0
        assert mine("specmesh.kv.blocks.free")[-1].value == stats.free_blocks
        assert mine("specmesh.prefix.hit_tokens")[-1].value == stats.prefix_hit_tokens > 0
        assert "specmesh.kv.fragmentation" in points and "specmesh.queue.depth" in points
        assert "specmesh.preemptions" in points and "specmesh.kv.evictions" in points
        ttft = points["gen_ai.server.time_to_first_token"]
        assert sum(p.count for p in ttft) >= 2
        assert sum(p.count for p in points["gen_ai.server.time_per_output_token"]) >= 2 * 7
        assert sum(p.count for p in points["specmesh.batch.size"]) > 0
    finally:
        await mesh.stop()
