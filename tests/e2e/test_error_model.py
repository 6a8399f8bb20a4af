"""Malformed bytes, two credentials, unknown pools, duplicate request ids,
router health without targets, and the rich error model — through real servers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import details_of
from specmesh.proto.v1 import (
    common_pb2,
    router_service_pb2,
    target_service_pb2,
)
from services.common.server import ServerConfig
from services.target.server.app import build_target_server
from tests.mesh import AUTH_A, TOKEN_A, TOKEN_B, collect, request, start_mesh

ROUTER_GENERATE = "/specmesh.v1.RouterService/Generate"
TARGET_GENERATE = "/specmesh.v1.TargetService/Generate"


def _raw_call(channel: grpc.aio.Channel, method: str, payload: bytes, metadata=AUTH_A):
    """A unary-stream call that sends `payload` as the request's bytes, unparsed."""
    return channel.unary_stream(method, request_serializer=None,
                                response_deserializer=None)(payload, metadata=metadata, timeout=30)


async def _code_of(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value


@pytest.fixture
async def mesh(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    yield mesh
    await mesh.stop()


# prompt (field 1) holding invalid UTF-8, a truncated length prefix, a wrong wire type.
MALFORMED = [b"\x0a\x02\xff\xfe", b"\x0a\x05ab", b"\x0f\x01", b"\x12\x03\x08"]


@pytest.mark.parametrize("payload", MALFORMED)
async def test_malformed_bytes_are_invalid_argument_at_router_and_target(mesh, payload):
    error = await _code_of(_raw_call(mesh.channel, ROUTER_GENERATE, payload))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(error)["ErrorInfo"].reason == "MALFORMED_REQUEST"
    async with grpc.aio.insecure_channel(mesh.target.address) as target:
        error = await _code_of(_raw_call(target, TARGET_GENERATE, payload, metadata=()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    ids, _, last = await collect(mesh.router_stub, request("still serving", 4))
    assert last.usage.completion_tokens == 4


async def test_two_authorization_headers_are_refused(mesh):
    for metadata in ((("authorization", f"Bearer {TOKEN_A}"), ("authorization", f"Bearer {TOKEN_B}")),
                     (("authorization", "Bearer unknown"), ("authorization", f"Bearer {TOKEN_A}"))):
        error = await _code_of(mesh.router_stub.Generate(request("hi", 2), metadata=metadata))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization headers" in error.details()
        assert details_of(error)["ErrorInfo"].reason == "UNAUTHENTICATED"


async def test_unknown_model_is_invalid_argument_and_empty_or_default_is_served(mesh):
    req = request("hello", 2)
    req.model = "no-such-pool"
    error = await _code_of(mesh.router_stub.Generate(req, metadata=AUTH_A))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    for model in ("", "default"):
        req.model = model
        _, _, last = await collect(mesh.router_stub, req)
        assert last.usage.completion_tokens == 2


async def test_invalid_sampling_lists_every_field_violation(mesh):
    req = request("hello", 0, temperature=float("nan"), top_p=2.0, top_k=-1)
    error = await _code_of(mesh.router_stub.Generate(req, metadata=AUTH_A))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = details_of(error)
    assert details["ErrorInfo"].reason == "INVALID_REQUEST"
    assert details["ErrorInfo"].domain == "specmesh.dev"
    assert [v.field for v in details["BadRequest"].field_violations] == [
        "sampling.max_tokens", "sampling.temperature", "sampling.top_k", "sampling.top_p"]


async def test_a_targets_rich_error_reaches_the_caller_through_the_router(mesh):
    """The router re-stamps the target's details with its own message (grpc-status's
    from_call refuses details whose message differs from the call's)."""
    error = await _code_of(mesh.router_stub.Generate(request("word " * 600, 4), metadata=AUTH_A))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the model context" in error.details()
    assert details_of(error)["ErrorInfo"].reason == "INVALID_REQUEST"


async def test_overload_carries_retry_info(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, max_num_seqs=1, max_queued_requests=0)
    try:
        stub = mesh.target_stub()
        first = stub.Generate(target_service_pb2.TargetServiceGenerateRequest(
            request_id="busy", prompt="keep the engine busy",
            sampling=common_pb2.SamplingParams(max_tokens=200)))
        await first.read()  # admitted and streaming
        error = await _code_of(stub.Generate(target_service_pb2.TargetServiceGenerateRequest(
            request_id="extra", prompt="one more", sampling=common_pb2.SamplingParams(max_tokens=2))))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = details_of(error)
        assert details["ErrorInfo"].reason == "OVERLOADED"
        assert details["RetryInfo"].retry_delay.ToMilliseconds() == 250
        assert ("grpc-retry-pushback-ms", "250") in tuple(error.trailing_metadata())
        first.cancel()
    finally:
        await mesh.stop()


async def test_duplicate_request_id_is_refused_and_the_original_keeps_streaming(mesh):
    stub = mesh.target_stub()

    def generate(max_tokens):
        return stub.Generate(target_service_pb2.TargetServiceGenerateRequest(
            request_id="same-id", prompt="The original request", tenant_salt="t",
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens)), timeout=60)
    original = generate(40)
    first = await original.read()  # streaming now
    error = await _code_of(generate(4))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(error)["ErrorInfo"].reason == "DUPLICATE_REQUEST_ID"
    tokens, last = list(first.chunk.token_ids), None
    while (response := await original.read()) != grpc.aio.EOF:  # before the fix: aborted, hung
        tokens.extend(response.chunk.token_ids)
        last = response.chunk
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(tokens) == 40


async def _router_health(mesh) -> int:
    stub = health_pb2_grpc.HealthStub(mesh.channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status


async def _wait_health(mesh, status, seconds=20.0):
    for _ in range(int(seconds / 0.1)):
        if await _router_health(mesh) == status:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"router health never became {status}")


async def test_router_is_not_serving_while_no_target_is_reachable(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    restarted = None
    try:
        assert await _router_health(mesh) == health_pb2.HealthCheckResponse.SERVING
        port = mesh.target.port
        await mesh.target.stop(grace=0.1)
        await _wait_health(mesh, health_pb2.HealthCheckResponse.NOT_SERVING)
        # The target comes back on the same address: the router serves again.
        from dataclasses import replace

        from services.target.engine.engine import Engine
        engine = Engine.load(replace(mesh.engine.config))
        restarted = build_target_server(ServerConfig(port=port), engine, "tiny")
        await restarted.start()
        await _wait_health(mesh, health_pb2.HealthCheckResponse.SERVING)
        _, _, last = await collect(mesh.router_stub, request("back again", 3))
        assert last.usage.completion_tokens == 3
    finally:
        await mesh.channel.close()
        await mesh.router.stop(grace=0.5)
        if restarted is not None:
            await restarted.stop(grace=0.5)


def test_rich_status_round_trips_through_grpc_status():
    from services.common.errors import Violation, rich_status
    status = rich_status(grpc.StatusCode.INVALID_ARGUMENT, "bad", "INVALID_REQUEST",
                         [Violation("prompt", "prompt is empty")], retry_after_s=1.5)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [k for k, _ in status.trailing_metadata] == ["grpc-status-details-bin"]
    assert router_service_pb2  # the module the router's errors describe
