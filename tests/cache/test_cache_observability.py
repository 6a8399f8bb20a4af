"""Cache service spans (cache.prefix_match, cache.tool_lookup) and hit/miss/wait counters."""

from __future__ import annotations

import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.cache.identity import caller_metadata
from specmesh.proto.v1 import cache_service_pb2 as pb
from specmesh.proto.v1 import cache_service_pb2_grpc
from services.common.telemetry import serve_metrics

A = caller_metadata("tenant-a")


def scrape() -> dict[str, float]:
    """The cache service's /metrics: lookups by (kind, result), and the prefix index series."""
    port = serve_metrics("cache", "127.0.0.1", 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "specmesh_cache_lookups_total":
                key = (sample.labels["specmesh_cache_kind"], sample.labels["specmesh_cache_result"])
                out[key] = out.get(key, 0) + sample.value
            elif sample.name.startswith("specmesh_cache_prefix_index"):
                out[sample.name] = out.get(sample.name, 0) + sample.value
    return out


async def test_spans_and_lookup_counters(spans):
    before = scrape()
    server = build_cache_server(CacheConfig(replicas=("127.0.0.1:1",)))  # never reachable: not synced
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = cache_service_pb2_grpc.CacheServiceStub(channel)
            reply = await stub.PrefixMatch(pb.PrefixMatchRequest(block_hashes=[1, 2, 3]))
            assert [(m.replica, m.matched_blocks, m.synced) for m in reply.matches] == [("127.0.0.1:1", 0, False)]
            tool = dict(tool="search", tool_version="7", arguments_json='{"q": "secret words"}')
            lease = await stub.ToolLookup(pb.ToolLookupRequest(**tool), metadata=A)
            await stub.ToolStore(pb.ToolStoreRequest(**tool, lease_id=lease.lease_id, value=b"secret"),
                                 metadata=A)
            await stub.ToolLookup(pb.ToolLookupRequest(**tool), metadata=A)
            oversized = pb.PrefixMatchRequest(block_hashes=list(range(65537)))
            try:
                await stub.PrefixMatch(oversized)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "65537 block hashes" in exc.details()
            else:
                raise AssertionError("an oversized PrefixMatch was accepted")
    finally:
        await server.stop(0)
    finished = spans.get_finished_spans()
    match = [s for s in finished if s.name == "cache.prefix_match"]
    assert [(s.attributes["specmesh.prefix_query_blocks"], s.attributes["specmesh.prefix_hit_blocks"])
            for s in match] == [(3, 0)]
    assert [s.attributes["specmesh.cache_outcome"] for s in finished if s.name == "cache.tool_lookup"] \
        == ["lease_granted", "hit"]
    assert not any("secret" in str(v) for s in finished for v in s.attributes.values())
    after = scrape()
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    lookups = {k: v for k, v in delta.items() if isinstance(k, tuple)}
    assert lookups == {("prefix", "miss"): 1, ("tool", "miss"): 1, ("tool", "hit"): 1}
    assert delta["specmesh_cache_prefix_index_query_duration_seconds_count"] == 1
    assert "specmesh_cache_prefix_index_size" in after
    assert "specmesh_cache_prefix_index_resyncs_total" in after
