"""The engine never dies silently: a fault injected into its loop outside a step (the engine's
own fault point, services/target/engine/fault_point.py) fails every live request with INTERNAL,
turns health NOT_SERVING, shows in GetStats, and the process exits non-zero (`specmesh serve
target`) or is restarted (`specmesh up`). Real servers, mutual TLS, tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common.env import DEV_TOKEN
from services.common.healthcheck import check
from services.common.tls import MeshTls, internal_channel, make_dev_certs
from specmesh.proto.v1 import (common_pb2, router_service_pb2, router_service_pb2_grpc, target_service_pb2,
                               target_service_pb2_grpc)
from tests.mesh import start_mesh
from tests.processes import free_port, free_port_run, wait_until_serving

EXIT_ENGINE_FAILED = 70


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("mesh-certs"))


def _long(request_id: str) -> target_service_pb2.TargetServiceGenerateRequest:
    return target_service_pb2.TargetServiceGenerateRequest(
        request_id=request_id, prompt="once upon a time " * 4, tenant_salt="salt",
        sampling=common_pb2.SamplingParams(max_tokens=200))


async def _until_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while await call.read() is not grpc.aio.EOF:
            pass
    return info.value


async def _health(channel) -> int:
    from grpc_health.v1 import health_pb2_grpc
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return response.status


async def test_a_loop_fault_fails_live_requests_and_turns_the_target_not_serving(tiny_llama_dir, certs):
    mesh = await start_mesh(tiny_llama_dir, tls_dir=certs)
    stub = mesh.target_stub()
    health_channel = internal_channel(mesh.target.address, MeshTls.from_dir(certs, "router"))
    try:
        calls = [stub.Generate(_long(f"live-{i}"), timeout=60) for i in range(3)]
        for call in calls:
            await call.read()  # all three are streaming
        stats = await stub.GetStats(target_service_pb2.GetStatsRequest(), timeout=5)
        assert stats.engine_alive and stats.engine_steps > 0
        armed = time.monotonic()
        mesh.engine.inject_loop_fault()
        errors = [await _until_error(call) for call in calls]
        while await _health(health_channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - armed < 1.0, "health still SERVING a second after the fault"
            await asyncio.sleep(0.02)
        for error in errors:
            assert error.code() == grpc.StatusCode.INTERNAL
            assert "engine failed outside a step (InjectedFault: fault injected at engine.loop)" in error.details()
        assert mesh.target.engine_failed.is_set()  # what the runner exits (or restarts) on
        stats = await stub.GetStats(target_service_pb2.GetStatsRequest(), timeout=5)
        assert not stats.engine_alive and "InjectedFault" in stats.engine_error
        later = await _until_error(stub.Generate(_long("later"), timeout=10))  # never a hang to the deadline
        assert later.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await health_channel.close()
        await mesh.stop()


def _env(certs) -> dict:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")},
            "PYTHONUNBUFFERED": "1", "SPECMESH_TLS_DIR": str(certs), "SPECMESH_FAULT_INJECTION": "1"}


def _router_tls(certs) -> MeshTls:
    return MeshTls.from_dir(certs, "router")


def test_serve_target_exits_non_zero_when_its_engine_fails(tiny_llama_dir, certs):
    port = free_port()
    address = f"127.0.0.1:{port}"
    target = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "target", "--port", str(port),
                               "--model", str(tiny_llama_dir), "--dtype", "float32",
                               "--speculation-method", "off"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(certs))
    tls = MeshTls.from_dir(certs, "target")
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if check(address, timeout=1.0, tls=tls) == "SERVING":
                    break
            except grpc.RpcError:
                pass
            assert target.poll() is None and time.monotonic() < deadline, target.stdout.read()
            time.sleep(0.2)

        async def fail_live_requests() -> list[grpc.aio.AioRpcError]:
            channel = internal_channel(address, _router_tls(certs))
            stub = target_service_pb2_grpc.TargetServiceStub(channel)
            calls = [stub.Generate(_long(f"live-{i}"), timeout=60) for i in range(2)]
            for call in calls:
                await call.read()
            target.send_signal(signal.SIGUSR1)  # arms the engine loop's fault point
            errors = [await _until_error(call) for call in calls]
            await channel.close()
            return errors
        errors = asyncio.run(fail_live_requests())
        assert [e.code() for e in errors] == [grpc.StatusCode.INTERNAL] * 2
        assert target.wait(timeout=60) == EXIT_ENGINE_FAILED
    finally:
        if target.poll() is None:
            target.kill()
        out = target.stdout.read()
    assert "target engine failed" in out and "exiting with status 70" in out


@pytest.mark.slow
def test_up_restarts_a_target_whose_engine_failed(tiny_llama_dir, certs):
    base = free_port_run(4)
    router, target = f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"
    env = {**_env(certs), "SPECMESH_TLS_DIR": ""}  # up makes its own certificates
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(base), "--gateway-port", "0",
                           "--model", str(tiny_llama_dir), "--dtype", "float32", "--speculation-method", "off"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = ""
    try:
        wait_until_serving(up, [router], timeout_s=180)

        async def generate() -> int:
            async with grpc.aio.insecure_channel(router) as channel:
                tokens = 0
                async for response in router_service_pb2_grpc.RouterServiceStub(channel).Generate(
                        router_service_pb2.GenerateRequest(prompt="hello", sampling=common_pb2.SamplingParams(
                            max_tokens=4)), metadata=(("authorization", f"Bearer {DEV_TOKEN}"),), timeout=30):
                    tokens += len(response.chunk.token_ids)
                return tokens
        assert asyncio.run(generate()) == 4
        up.send_signal(signal.SIGUSR1)
        line = seen = ""
        while "restarted on" not in line:
            line = up.stdout.readline()
            assert line, "up exited"
            seen += line
        for _ in range(100):  # the router sees the fresh target within its health poll
            try:
                if asyncio.run(generate()) == 4:
                    break
            except grpc.RpcError:
                time.sleep(0.2)
        else:
            raise AssertionError("the router never reached the restarted target")
        assert up.poll() is None
    finally:
        up.send_signal(signal.SIGINT)
        try:
            out, _ = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            out, _ = up.communicate()
    assert "target: engine failed; restarting it" in seen
    assert up.returncode == 0, out
