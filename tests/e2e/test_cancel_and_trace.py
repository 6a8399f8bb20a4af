"""Cancellation frees KV blocks at once; one trace spans router and target."""

from __future__ import annotations

import asyncio

from specmesh.proto.v1 import target_service_pb2
from tests.mesh import AUTH_A, collect, request, start_mesh
from tests.e2e.test_generate import hf_greedy


async def _wait_for(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_cancelling_a_stream_frees_all_its_blocks_and_others_finish(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    target = mesh.target_stub()
    try:
        others = [asyncio.create_task(collect(mesh.router_stub, request(p, max_tokens=40)))
                  for p in ("The quick brown fox", "Once upon a time")]
        call = mesh.router_stub.Generate(request("a long story " * 5, max_tokens=200), metadata=AUTH_A)
        received = 0
        async for response in call:
            received += len(response.chunk.token_ids)
            if received >= 5:
                break
        stats = await target.GetStats(target_service_pb2.GetStatsRequest())
        assert stats.used_blocks > 0
        call.cancel()
        results = await asyncio.gather(*others)
        assert results[0][0] == hf_greedy(tiny_llama_dir, "The quick brown fox", 40)
        assert results[1][0] == hf_greedy(tiny_llama_dir, "Once upon a time", 40)

        async def all_free():
            s = await target.GetStats(target_service_pb2.GetStatsRequest())
            return s.free_blocks == s.num_blocks and s.running_requests == 0
        await _wait_for(all_free)
    finally:
        await mesh.stop()


async def test_one_trace_spans_router_and_target(tiny_llama_dir, spans):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        await collect(mesh.router_stub, request("hello there", max_tokens=6))
        expected = {("route", "INTERNAL"), ("/specmesh.v1.RouterService/Generate", "SERVER"),
                    ("/specmesh.v1.TargetService/Generate", "SERVER"),
                    ("/specmesh.v1.TargetService/Generate", "CLIENT"), ("target.generate", "INTERNAL")}

        async def all_ended():  # the phase spans are written on their own thread
            return expected <= {(s.name, s.kind.name) for s in spans.get_finished_spans()}
        try:
            await _wait_for(all_ended)
        except AssertionError:
            raise AssertionError("spans missing; got " + repr(sorted(
                (s.name, s.kind.name, s.resource.attributes.get("service.name"), f"{s.context.trace_id:032x}")
                for s in spans.get_finished_spans()))) from None
        finished = spans.get_finished_spans()
        by_name = {}
        for span in finished:
            by_name.setdefault(span.name, []).append(span)
        route = by_name["route"][0]
        router_server = next(s for s in by_name["/specmesh.v1.RouterService/Generate"]
                             if s.kind.name == "SERVER")
        target_server = next(s for s in by_name["/specmesh.v1.TargetService/Generate"]
                             if s.kind.name == "SERVER")
        router_client = next(s for s in by_name["/specmesh.v1.TargetService/Generate"]
                             if s.kind.name == "CLIENT")
        trace_id = router_server.context.trace_id
        assert route.context.trace_id == trace_id
        assert target_server.context.trace_id == trace_id
        # Parent to child across the gRPC hop: router server -> router client -> target server.
        assert router_client.parent.span_id == router_server.context.span_id
        assert target_server.parent.span_id == router_client.context.span_id
        generate = by_name["target.generate"][0]
        assert generate.parent.span_id == target_server.context.span_id
        assert generate.attributes["gen_ai.usage.output_tokens"] == 6
        for span in finished:  # no prompt text in any attribute
            assert all("hello there" not in str(v) for v in (span.attributes or {}).values())
        assert not any(s.name.startswith("/grpc.health") for s in finished)
    finally:
        await mesh.stop()
