"""Internal services: bytes that do not parse are INVALID_ARGUMENT at the
draft and cache services too (not UNKNOWN), and the server keeps serving."""

from __future__ import annotations

import grpc
import pytest

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.cache.identity import caller_metadata
from services.common.server import ServerConfig
from specmesh.proto.v1 import draft_service_pb2_grpc
from tests.mesh import start_draft

# A field 1 (length-delimited) that claims more bytes than follow; and a string field with
# invalid UTF-8 (proto3 strings must be UTF-8).
TRUNCATED = b"\x0a\x05ab"
BAD_UTF8 = b"\x0a\x02\xff\xfe"


async def _unary_code(address: str, method: str, payload: bytes, metadata=()) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(payload, metadata=metadata, timeout=10)
        return info.value.code()


@pytest.mark.parametrize("payload", [TRUNCATED, BAD_UTF8])
async def test_draft_answers_malformed_bytes_with_invalid_argument(payload):
    server = await start_draft()
    try:
        code = await _unary_code(server.address, "/specmesh.v1.DraftService/Release", payload)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        async with grpc.aio.insecure_channel(server.address) as channel:  # still serving
            stub = draft_service_pb2_grpc.DraftServiceStub(channel)
            from specmesh.proto.v1 import draft_service_pb2
            names = [n for n in dir(draft_service_pb2) if n.startswith("Release") and n.endswith("Request")]
            reply = await stub.Release(getattr(draft_service_pb2, names[0])(), timeout=10)
            assert reply.released == 0
    finally:
        await server.stop(grace=0)


@pytest.mark.parametrize("payload", [TRUNCATED, BAD_UTF8])
async def test_cache_answers_malformed_bytes_with_invalid_argument(payload):
    server = build_cache_server(CacheConfig(server=ServerConfig(port=0)))
    await server.start()
    try:
        code = await _unary_code(server.address, "/specmesh.v1.CacheService/Get", payload,
                                 caller_metadata("tenant-a"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(grace=0)
