"""One request contract across the gRPC seam (services/common/request_checks.py): the router
and a target called directly refuse the same bad request with the same status, message and
field violations; the request id the router mints is the one the target serves under."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from services.common.errors import details_of
from specmesh.proto.v1 import common_pb2, router_service_pb2, target_service_pb2, tools_pb2
from tests.mesh import collect, request, start_mesh


def _chat(*contents: str, **sampling) -> router_service_pb2.GenerateRequest:
    return router_service_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content=c) for c in contents],
        sampling=common_pb2.SamplingParams(max_tokens=sampling.pop("max_tokens", 4), **sampling))


_BAD_SCHEMA = common_pb2.Constraint(json_schema='{"type": "foo"}')
BAD = {  # name: (request, the reason the rich status gives)
    "empty prompt": (request("", max_tokens=4), "INVALID_REQUEST"),
    "whitespace-only prompt": (request(" \n\t ", max_tokens=4), "INVALID_REQUEST"),
    "whitespace-only messages": (_chat("  ", "\n"), "INVALID_REQUEST"),
    "prompt and messages": (router_service_pb2.GenerateRequest(
        prompt="hi", messages=[common_pb2.ChatMessage(role="user", content="hi")],
        sampling=common_pb2.SamplingParams(max_tokens=4)), "INVALID_REQUEST"),
    "tools without messages": (router_service_pb2.GenerateRequest(
        prompt="hi", tools=[tools_pb2.Tool(name="f")], sampling=common_pb2.SamplingParams(max_tokens=4)),
        "INVALID_REQUEST"),
    "max_tokens zero": (request("hello", max_tokens=0), "INVALID_REQUEST"),
    "max_tokens above the limit": (request("hello", max_tokens=257), "INVALID_REQUEST"),
    "temperature NaN": (request("hello", temperature=math.nan), "INVALID_REQUEST"),
    "top_p above 1 and top_k negative": (request("hello", top_p=1.5, top_k=-1), "INVALID_REQUEST"),
    "min_tokens above max_tokens": (request("hello", max_tokens=4, min_tokens=5), "INVALID_REQUEST"),
    "top_logprobs without logprobs": (request("hello", top_logprobs=2), "INVALID_REQUEST"),
    "n above the limit": (request("hello", n=10_000), "INVALID_REQUEST"),
    "invalid schema": (request("hello", constraint=_BAD_SCHEMA), "INVALID_REQUEST"),
    "too many stop sequences": (request("hello", stop=[f"s{i}" for i in range(17)]), "REQUEST_TOO_LARGE"),
    "prompt over the byte limit": (request("x" * ((1 << 20) + 1)), "REQUEST_TOO_LARGE"),
    "several problems": (request("  ", max_tokens=0, temperature=-1.0), "INVALID_REQUEST"),
}


def _as_target(req: router_service_pb2.GenerateRequest) -> target_service_pb2.TargetServiceGenerateRequest:
    return target_service_pb2.TargetServiceGenerateRequest(
        request_id="direct", prompt=req.prompt, messages=req.messages, tools=req.tools, sampling=req.sampling)


async def _refusal(stub, req, metadata=None) -> tuple:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(req, metadata=metadata):
            pass
    error = info.value
    details = details_of(error)
    return (error.code(), error.details(), details["ErrorInfo"].reason,
            [(v.field, v.description) for v in details["BadRequest"].field_violations])


async def test_router_and_target_refuse_the_same_bad_requests_alike(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    target = mesh.target_stub()
    try:
        for name, (bad, reason) in BAD.items():
            at_router = await _refusal(mesh.router_stub, bad, (("authorization", "Bearer token-a"),))
            at_target = await _refusal(target, _as_target(bad))
            assert at_router == at_target, name
            assert at_router[0] == grpc.StatusCode.INVALID_ARGUMENT and at_router[1], name
            assert at_router[2] == reason, name
        several = await _refusal(target, _as_target(BAD["several problems"][0]))
        assert [field for field, _ in several[3]] == ["sampling.max_tokens", "sampling.temperature", "prompt"]
        # Nothing refused reached the engine; the servers keep serving.
        stats = await target.GetStats(target_service_pb2.GetStatsRequest())
        assert stats.free_blocks == stats.num_blocks and stats.running_requests == 0
        ids, _, _ = await collect(mesh.router_stub, request("hello there", max_tokens=4))
        assert len(ids) == 4
    finally:
        await mesh.stop()


async def _wait_for_spans(spans, names: set[str]) -> dict:
    for _ in range(250):
        by_name = {s.name: s for s in spans.get_finished_spans()}
        if names <= set(by_name):
            return by_name
        await asyncio.sleep(0.02)
    raise AssertionError(f"spans missing: {names - set(by_name)}")


async def test_the_target_serves_under_the_request_id_the_router_minted(tiny_llama_dir, spans):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        await collect(mesh.router_stub, request("hello there", max_tokens=4))
        by_name = await _wait_for_spans(spans, {"route", "target.generate"})
        minted = by_name["route"].attributes["specmesh.request_id"]
        assert len(minted) == 32  # uuid4().hex
        assert by_name["target.generate"].attributes["specmesh.request_id"] == minted

        # Called directly, the target keeps the caller's id, and mints one only when none came.
        for request_id in ("caller-chose-this", ""):
            spans.clear()
            direct = _as_target(request("hello there", max_tokens=2))
            direct.request_id = request_id
            async for _ in mesh.target_stub().Generate(direct):
                pass
            served = (await _wait_for_spans(spans, {"target.generate"}))["target.generate"]
            served_as = served.attributes["specmesh.request_id"]
            assert served_as == request_id if request_id else len(served_as) == 32
    finally:
        await mesh.stop()
