"""One trace per request across router -> target <-> draft, read back by an in-process OTLP
trace receiver (the real OTLP gRPC exporter sends to it)."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.common.telemetry import add_span_exporter, remove_span_processor
from services.target.metrics import flush_traces
from tests.mesh import AUTH_A, collect, request, start_draft, start_mesh

DEADLINE_EXCEEDED, CANCELLED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0], grpc.StatusCode.CANCELLED.value[0]
STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    status: int
    attributes: dict
    events: list[str]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append(ReceivedSpan(
                            service, s.name, s.trace_id, s.span_id, s.parent_span_id, s.status.code,
                            {a.key: _value(a.value) for a in s.attributes}, [e.name for e in s.events]))
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(v):
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def otlp():
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    flush_traces()  # earlier tests' requests' phase spans are written before capture starts
    processor = add_span_exporter(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True), batch=True)

    def flush() -> list[ReceivedSpan]:
        flush_traces()
        processor.force_flush()
        return list(receiver.spans)
    yield flush
    remove_span_processor(processor)
    server.stop(0)


async def _until(predicate, flush, timeout=20.0):
    """Flushes until `predicate(spans)` holds (spans of released draft sequences end later)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        spans = await asyncio.to_thread(flush)
        if predicate(spans) or loop.time() > deadline:
            return spans
        await asyncio.sleep(0.05)


async def test_one_trace_holds_all_services_and_every_verify_pass(tiny_llama_dir, otlp):
    draft = await start_draft()
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address,
                            speculation={"speculation_method": "prompt_lookup", "speculation_depth": 4})
    try:
        prompt = "one two three four five six one two three four five six one two three"
        _, _, final = await collect(mesh.router_stub, request(prompt, max_tokens=24))
        assert final.usage.proposed_tokens > 0

        def done(spans):
            return any(s.name == "draft.sequence" for s in spans) and any(s.name == "verify" for s in spans)
        spans = await _until(done, otlp)
    finally:
        await mesh.stop()
        await draft.stop(grace=0)
    router_server = next(s for s in spans if s.name == "/specmesh.v1.RouterService/Generate")
    trace = [s for s in spans if s.trace_id == router_server.trace_id]
    orphans = [(s.name, s.service, s.trace_id.hex(), s.parent_span_id.hex()) for s in spans
               if s.trace_id != router_server.trace_id]
    assert not orphans, f"spans outside the request's trace: {orphans}"  # no orphan per-step traces
    assert {s.service for s in trace} == {"specmesh-tests-router", "specmesh-tests-target",
                                          "specmesh-tests-draft"}
    by_name = {s.name: s for s in trace}
    assert {"route", "queue", "prefill", "decode", "draft.propose", "verify", "draft.sequence",
            "target.generate"} <= set(by_name)
    generate = by_name["target.generate"]
    for phase in ("queue", "prefill", "decode", "draft.propose", "verify", "draft.sequence"):
        assert by_name[phase].parent_span_id == generate.span_id, phase
    assert by_name["draft.sequence"].service == "specmesh-tests-draft"
    verify = by_name["verify"]
    passes = generate.attributes["specmesh.verify_passes"]
    assert passes >= 1 and verify.events == ["verify.pass"] * passes
    assert verify.attributes["specmesh.proposed_tokens"] == final.usage.proposed_tokens
    assert verify.attributes["specmesh.accepted_tokens"] == final.usage.accepted_tokens
    prefill = by_name["prefill"].attributes  # cached prompt tokens by tier (here: none)
    assert prefill["specmesh.cached_prompt_tokens"] == final.usage.cached_prompt_tokens == 0
    assert prefill["specmesh.host_cached_prompt_tokens"] == final.usage.host_cached_prompt_tokens == 0
    assert prefill["specmesh.shared_cached_prompt_tokens"] == final.usage.shared_cached_prompt_tokens == 0
    assert all(s.status != STATUS_ERROR for s in trace)


async def test_a_request_past_its_deadline_has_error_spans(tiny_llama_dir, otlp):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        # A first request connects the channels and warms the engine, so the deadline below
        # expires while the target generates (a 20 ms deadline could expire in the router under
        # a loaded CPU, before any target span existed: 1 run in 4 failed that way).
        await collect(mesh.router_stub, request("warm up", max_tokens=2))
        call = mesh.router_stub.Generate(request("a long story " * 20, max_tokens=256), metadata=AUTH_A,
                                         timeout=0.15)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        def failed_trace(spans):
            router = [s for s in spans if s.name == "/specmesh.v1.RouterService/Generate"
                      and s.status == STATUS_ERROR]
            return [s for s in spans if router and s.trace_id == router[0].trace_id]

        def done(spans):
            return {"target.generate", "queue", "/specmesh.v1.RouterService/Generate"} <= {
                s.name for s in failed_trace(spans)}
        received = await _until(done, otlp)
        spans = failed_trace(received)
    finally:
        await mesh.stop()
    assert done(received), f"spans of the failed request missing; received: " + ", ".join(
        f"{s.service}:{s.name}:{s.status}:{s.trace_id.hex()[:6]}" for s in received)
    router_server = next(s for s in spans if s.name == "/specmesh.v1.RouterService/Generate")
    assert router_server.attributes["rpc.grpc.status_code"] == DEADLINE_EXCEEDED
    generate = next(s for s in spans if s.name == "target.generate")
    assert generate.status == STATUS_ERROR
    assert generate.attributes["rpc.grpc.status_code"] in (DEADLINE_EXCEEDED, CANCELLED)
