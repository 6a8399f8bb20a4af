"""Bad input gets INVALID_ARGUMENT / UNAUTHENTICATED and the servers keep serving."""

from __future__ import annotations

import math

import grpc
import pytest

from tests.mesh import AUTH_A, collect, request, start_mesh

BAD_REQUESTS = {
    "empty prompt": request("", max_tokens=4),
    "max_tokens zero": request("hello", max_tokens=0),
    "max_tokens negative": request("hello", max_tokens=-3),
    "max_tokens above limit": request("hello", max_tokens=257),
    "temperature NaN": request("hello", temperature=math.nan),
    "temperature infinite": request("hello", temperature=math.inf),
    "temperature negative": request("hello", temperature=-0.5),
    "top_p above 1": request("hello", top_p=1.5),
    "top_p negative": request("hello", top_p=-0.1),
    "top_p NaN": request("hello", top_p=math.nan),
    "top_k negative": request("hello", top_k=-1),
    "prompt plus max_tokens beyond context": request("word " * 400, max_tokens=200),
}


async def test_bad_requests_get_invalid_argument_and_the_server_keeps_serving(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        good, _, _ = await collect(mesh.router_stub, request("hello there", max_tokens=8))
        for name, bad in BAD_REQUESTS.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(mesh.router_stub, bad)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert info.value.details(), name
        again, _, _ = await collect(mesh.router_stub, request("hello there", max_tokens=8))
        assert again == good
        stats = await mesh.target_stub().GetStats(__import__(
            "specmesh.proto.v1.target_service_pb2", fromlist=["x"]).GetStatsRequest())
        assert stats.free_blocks == stats.num_blocks
    finally:
        await mesh.stop()


@pytest.mark.parametrize("metadata", [
    (),
    (("authorization", "Bearer not-a-token"),),
    (("authorization", "Basic dXNlcjpwYXNz"),),
], ids=["missing", "unknown", "wrong-scheme"])
async def test_missing_or_unknown_credential_is_unauthenticated(tiny_llama_dir, metadata):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.router_stub, request("hello", max_tokens=4), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ids, _, _ = await collect(mesh.router_stub, request("hello", max_tokens=4), metadata=AUTH_A)
        assert len(ids) == 4
    finally:
        await mesh.stop()


async def test_target_down_is_unavailable(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        await mesh.target.stop(grace=0.5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.router_stub, request("hello", max_tokens=4))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await mesh.stop()


async def test_expired_deadline_is_deadline_exceeded_and_frees_the_request(tiny_llama_dir):
    import asyncio

    from specmesh.proto.v1 import target_service_pb2
    mesh = await start_mesh(tiny_llama_dir)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in mesh.router_stub.Generate(request("a long story " * 5, max_tokens=250),
                                                     metadata=AUTH_A, timeout=0.05):
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(100):
            stats = await mesh.target_stub().GetStats(target_service_pb2.GetStatsRequest())
            if stats.used_blocks == 0 and stats.running_requests == 0:
                break
            await asyncio.sleep(0.05)
        assert stats.used_blocks == 0 and stats.running_requests == 0
        ids, _, _ = await collect(mesh.router_stub, request("hello", max_tokens=4))
        assert len(ids) == 4
    finally:
        await mesh.stop()


async def test_target_dying_mid_stream_ends_the_stream_with_an_error_not_ok(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        call = mesh.router_stub.Generate(request("a long story " * 5, max_tokens=250), metadata=AUTH_A)
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                received += len(response.chunk.token_ids)
                if received >= 3:
                    await mesh.target.stop(grace=0)  # the target goes away with tokens streamed
        assert received >= 3
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.code()
    finally:
        await mesh.stop()


@pytest.mark.parametrize("field,value", [
    ("prompt", ""), ("max_tokens", 0), ("temperature", math.nan), ("top_p", 2.0), ("top_k", -2),
])
async def test_target_called_directly_validates_too(tiny_llama_dir, field, value):
    from specmesh.proto.v1 import common_pb2, target_service_pb2
    mesh = await start_mesh(tiny_llama_dir)
    try:
        sampling = common_pb2.SamplingParams(max_tokens=4)
        prompt = "hello"
        if field == "prompt":
            prompt = value
        else:
            setattr(sampling, field, value)
        req = target_service_pb2.TargetServiceGenerateRequest(request_id="direct", prompt=prompt, sampling=sampling)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in mesh.target_stub().Generate(req):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await mesh.stop()
