"""Every service serves Prometheus /metrics: scraped after a few requests, the TTFT histogram
has the serving boundaries and a bucket label, its count equals the requests sent, and the
speculation counters (rejected tokens, fallbacks) are there per bucket."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common import metrics as m
from specmesh.proto.v1 import cache_service_pb2, cache_service_pb2_grpc, target_service_pb2
from services.common.server import ServerConfig
from services.common.telemetry import serve_metrics
from services.target.metrics import exported_gauges
from tests.mesh import collect, request, start_draft, start_mesh

SERVICES = ("router", "target", "draft", "cache")
BUCKET = "chat-short-greedy"


def scrape(port: int) -> dict[str, list]:
    """{sample name: [(labels, value), ...]} of one /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(page: dict, name: str, **labels) -> float:
    return sum(v for l, v in page.get(name, []) if all(l.get(k) == want for k, want in labels.items()))


async def test_every_service_serves_metrics_with_bucket_labels_and_serving_boundaries(tiny_llama_dir):
    from services.cache.app import build_cache_server
    from services.cache.config import CacheConfig

    ports = {s: serve_metrics(s, "127.0.0.1", 0) for s in SERVICES}
    draft = await start_draft()
    mesh = await start_mesh(tiny_llama_dir, num_blocks=64, draft_address=draft.address,
                            speculation={"speculation_method": "prompt_lookup", "speculation_depth": 4})
    cache = build_cache_server(CacheConfig(server=ServerConfig(port=0)))
    await cache.start()
    ttft = "gen_ai_server_time_to_first_token_seconds"
    try:
        before = {s: await asyncio.to_thread(scrape, ports[s]) for s in SERVICES}
        prompt = "one two three four one two three four one two three"
        for i in range(3):
            await collect(mesh.router_stub, request(f"{prompt} {i}", max_tokens=12))
        await draft.stop(grace=0)  # the next request's steps fall back to plain decoding
        await collect(mesh.router_stub, request(f"{prompt} 3", max_tokens=12))
        async with grpc.aio.insecure_channel(cache.address) as channel:
            try:
                await cache_service_pb2_grpc.CacheServiceStub(channel).PrefixMatch(
                    cache_service_pb2.PrefixMatchRequest())
            except grpc.aio.AioRpcError:
                pass  # counted by status either way
        await mesh.target_stub().GetStats(target_service_pb2.GetStatsRequest())
        after = {s: await asyncio.to_thread(scrape, ports[s]) for s in SERVICES}
    finally:
        await mesh.stop()
        await cache.stop(grace=0)

    for service in ("router", "target"):
        sent = value(after[service], f"{ttft}_count", specmesh_bucket=BUCKET) - \
            value(before[service], f"{ttft}_count", specmesh_bucket=BUCKET)
        assert sent == 4, service
        bounds = sorted({float(l["le"]) for l, _ in after[service][f"{ttft}_bucket"]})
        assert bounds == [*m.LATENCY_BOUNDS, float("inf")]
        tpot_bounds = sorted({float(l["le"]) for l, _ in after[service]["gen_ai_server_time_per_output_token_seconds_bucket"]})
        assert tpot_bounds == [*m.TPOT_BOUNDS, float("inf")]
    target = after["target"]
    for name in ("specmesh_speculation_rejected_tokens_total", "specmesh_speculation_proposed_tokens_total",
                 "specmesh_speculation_fallbacks_total", "specmesh_speculation_verify_time_seconds_count",
                 "specmesh_request_queue_time_seconds_count", "specmesh_kv_blocks_used"):
        assert any(l.get("specmesh_bucket", BUCKET) == BUCKET for l, _ in target[name]), name
    assert value(target, "specmesh_speculation_fallbacks_total", specmesh_bucket=BUCKET) >= 1
    proposed = value(target, "specmesh_speculation_proposed_tokens_total", specmesh_bucket=BUCKET)
    accepted = value(target, "specmesh_speculation_accepted_tokens_total", specmesh_bucket=BUCKET)
    assert value(target, "specmesh_speculation_rejected_tokens_total", specmesh_bucket=BUCKET) == proposed - accepted
    assert value(after["router"], "specmesh_requests_total", specmesh_bucket=BUCKET, specmesh_status="OK") - \
        value(before["router"], "specmesh_requests_total", specmesh_bucket=BUCKET, specmesh_status="OK") == 4
    assert value(after["draft"], "specmesh_draft_sequences_total", specmesh_speculation_method="prompt_lookup") > 0
    cache_calls = [l for l, _ in after["cache"]["rpc_server_call_duration_seconds_count"]
                   if l["rpc_method"] == "/specmesh.v1.CacheService/PrefixMatch"]
    assert cache_calls
    known = m.prometheus_names(exported_gauges())  # what the dashboard test checks queries against
    for service in ("router", "target", "draft"):
        exported = {name for name in after[service] if name.startswith(("specmesh_", "gen_ai_", "rpc_"))}
        assert exported <= known, (service, sorted(exported - known))
    for page in after.values():  # each endpoint serves its own service only
        assert len({l["service_name"] for l, _ in page.get("target_info", [])}) == 1
