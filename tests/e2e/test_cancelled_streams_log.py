"""Cancelled streams leave no traceback in the target's log ("Failed to detach context" came
from a trace context attached across a `yield`, services/common/trace_interceptor.py).
`specmesh serve target` as a subprocess, mutual TLS, tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc

from services.common.healthcheck import check
from services.common.tls import MeshTls, internal_channel, make_dev_certs
from specmesh.proto.v1 import common_pb2, target_service_pb2, target_service_pb2_grpc
from tests.processes import free_port


def _request(i: int) -> target_service_pb2.TargetServiceGenerateRequest:
    return target_service_pb2.TargetServiceGenerateRequest(
        request_id=f"cancel-{i}", prompt="once upon a time " * (1 + i % 4), tenant_salt="salt",
        sampling=common_pb2.SamplingParams(max_tokens=200))


async def _cancel_40(address: str, tls: MeshTls) -> None:
    async with internal_channel(address, tls) as channel:
        stub = target_service_pb2_grpc.TargetServiceStub(channel)

        async def one(i: int) -> None:
            call = stub.Generate(_request(i), timeout=60 if i % 4 else 0.3)  # some end at their deadline
            try:
                for _ in range(1 + i % 3):
                    await call.read()
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            call.cancel()
        for first in range(0, 40, 10):  # ten at a time, so cancellations meet busy streams
            await asyncio.gather(*(one(i) for i in range(first, first + 10)))
        await asyncio.sleep(1.0)


def test_forty_cancelled_streams_leave_no_traceback_in_the_target_log(tiny_llama_dir, tmp_path):
    certs = make_dev_certs(tmp_path / "certs")
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")}, "PYTHONUNBUFFERED": "1"}
    target = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "target", "--port", str(port),
                               "--tls-dir", str(certs), "--model", str(tiny_llama_dir), "--dtype", "float32",
                               "--speculation-method", "off"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if check(address, timeout=1.0, tls=MeshTls.from_dir(certs, "target")) == "SERVING":
                    break
            except grpc.RpcError:
                pass
            assert target.poll() is None and time.monotonic() < deadline, target.stdout.read()
            time.sleep(0.2)
        asyncio.run(_cancel_40(address, MeshTls.from_dir(certs, "router")))
    finally:
        target.send_signal(signal.SIGTERM)
        try:
            out, _ = target.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            target.kill()
            out, _ = target.communicate()
    assert target.returncode == 0, out
    assert "Traceback" not in out and "Failed to detach context" not in out, out
