"""SIGTERM-style shutdown: NOT_SERVING first, in-flight streams finish, new calls are refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.mesh import AUTH_A, collect, request, start_mesh
from tests.e2e.test_generate import hf_greedy


async def test_stopping_the_router_drains_in_flight_streams(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        call = mesh.router_stub.Generate(request("Once upon a time", 150), metadata=AUTH_A)
        first = await call.read()  # the stream is in flight
        stopping = asyncio.create_task(mesh.router.stop(grace=30))
        health = health_pb2_grpc.HealthStub(mesh.channel)
        for _ in range(100):
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.01)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.router_stub, request("hello", 4))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        ids = list(first.chunk.token_ids)
        while (response := await call.read()) is not grpc.aio.EOF:
            ids.extend(response.chunk.token_ids)
        assert ids == hf_greedy(tiny_llama_dir, "Once upon a time", 150)
        await stopping
    finally:
        await mesh.stop()


def test_engine_shutdown_returns_after_its_torch_thread_has_ended(tiny_llama_dir):
    # A process that exits while the engine's torch thread still runs can abort at exit
    # ("terminate called without an active exception", status 134; seen with
    # benchmarks/engine_step.py), so shutdown waits for the thread.
    from services.target.config import EngineConfig
    from services.target.engine.engine import Engine
    engine = Engine.load(EngineConfig(model_dir=tiny_llama_dir, dtype="float32", num_blocks=32, block_size=4))
    engine.start()
    thread = engine._torch_thread._thread
    engine.shutdown()
    assert not thread.is_alive()
