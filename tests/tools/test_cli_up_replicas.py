"""`specmesh up --replicas 2` starts two target replicas of the default pool; the router
spreads requests over both (round_robin here, so the order is known)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import grpc

from specmesh.proto.v1 import router_service_pb2_grpc
from tests.mesh import request
from tests.processes import free_port_run, wait_until_serving
from tests.routing_mesh import generate


def test_up_with_two_replicas_routes_over_both(tiny_llama_dir):
    base = free_port_run(5)  # router, target, draft, cache, second target
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(base), "--dev",
                           "--model", str(tiny_llama_dir), "--dtype", "float32", "--replicas", "2",
                           "--replica-policy", "round_robin", "--speculation-method", "off",
                           "--metrics-base-port", "0", "--num-blocks", "256", "--gateway-port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        addresses = [f"127.0.0.1:{base + i}" for i in range(5)]
        wait_until_serving(up, addresses, timeout_s=120)

        async def two_routes():
            async with grpc.aio.insecure_channel(addresses[0]) as channel:
                stub = router_service_pb2_grpc.RouterServiceStub(channel)
                auth = (("authorization", "Bearer specmesh-dev-token"),)
                return [(await generate(stub, request(f"hello {i}", 4), auth))[3] for i in range(2)]
        routes = asyncio.run(two_routes())
        assert {r.replica for r in routes} == {addresses[1], addresses[4]}
        assert all(r.pool == "default" for r in routes)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            out, _ = up.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            out, _ = up.communicate()
    assert up.returncode == 0, out
