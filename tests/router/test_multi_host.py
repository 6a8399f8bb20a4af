"""The mesh with its targets on hosts of their own (tests/netns.py): each target a
`specmesh serve target` process in its own network namespace and address, found by the
router through one DNS name (`dns:///POOL:50052`, like a headless Service) and reached by
its own DNS name over mutual TLS with certificates issued for DNS names only (the
addresses 10.231.N.2 are in no certificate). A replica added to DNS is used within one
re-resolution period, a removed one is ejected, and a request waiting on a replica that
dies before its first token is retried on another. The cache's prefix index follows the
same DNS entry and keys each target by the same name the router does."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from contextlib import ExitStack

import grpc
import pytest

from services.common.healthcheck import check
from services.common.mesh_config import MeshConfig, PoolConfig, TenantConfig
from services.common.tls import MeshTls, make_dev_certs
from tests.mesh import request
from tests.netns import Hosts, NetnsHost, netns_available
from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.common.server import ServerConfig
from tests.routing_mesh import generate, start_router

_why_not = netns_available()
pytestmark = pytest.mark.skipif(bool(_why_not), reason=f"network namespaces: {_why_not}")
DOMAIN = "hosts.specmesh.test"
POOL = f"targets.{DOMAIN}"  # the "headless Service": every target's address
PORT = 50052
PERIOD_S = 1.0  # the router's replica poll (and DNS re-resolution) period
AUTH = (("authorization", "Bearer tok"),)
PROMPT = "hello there, " * 24  # full KV blocks (cached, so the prefix index sees them)


def _serve_target(host: NetnsHost, model_dir, certs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECMESH_TLS_DIR": str(certs)}
    return host.popen([sys.executable, "-m", "services.cli", "serve", "target", "--host", host.address,
                       "--port", str(PORT), "--model", str(model_dir), "--dtype", "float32",
                       "--speculation-method", "off", "--metrics-port", "0"], env)


def _wait_serving(proc, name: str, tls: MeshTls, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check(f"{name}:{PORT}", timeout=1.0, tls=tls) == "SERVING":
                return
        except grpc.RpcError:
            pass
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"{name} did not serve in {timeout_s} s"
        time.sleep(0.3)


async def _until(predicate, timeout_s: float) -> float:
    """Seconds until `predicate()` held (fails after timeout_s)."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_targets_on_their_own_hosts_found_by_dns(tiny_llama_dir, tmp_path):
    certs = make_dev_certs(tmp_path / "certs", hosts=[f"target=*.{DOMAIN}"])
    router_tls = MeshTls.from_dir(certs, "router")
    with ExitStack() as stack:
        hosts = stack.enter_context(Hosts())
        machines = [stack.enter_context(NetnsHost(i)) for i in range(3)]
        names = [f"target-{i}.{DOMAIN}" for i in range(3)]
        procs = [_serve_target(m, tiny_llama_dir, certs) for m in machines]
        for machine, name in zip(machines, names):
            hosts.add(machine.address, name)  # the pod's own name first: its reverse name
        for machine, proc, name in zip(machines, procs, names):
            _wait_serving(proc, name, router_tls)
        for machine in machines[:2]:
            hosts.add(machine.address, POOL)
        keys = [f"{name}:{PORT}" for name in names]

        mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(tiny_llama_dir),
                                            replicas=(f"dns:///{POOL}:{PORT}",)),),
                          tenants=(TenantConfig(name="t", token="tok"),))
        cache_tls = MeshTls.from_dir(certs, "cache")
        cache = build_cache_server(CacheConfig(server=ServerConfig(port=0, tls=cache_tls.server_tls()),
                                               replicas=(f"dns:///{POOL}:{PORT}",), mesh_tls=cache_tls))
        cache.service.subscribers.resolve_seconds = PERIOD_S
        await cache.start()
        index = cache.service.index
        router = await start_router(mesh, cache_address=cache.address, replica_policy="round_robin",
                                    poll_interval_s=PERIOD_S, mesh_tls=router_tls)
        replicas = router.service.routing.pools["default"].replicas
        try:
            await router.service.start()  # (else on the first request): the first resolution
            # Two replicas by their DNS names, answering over mutual TLS.
            assert sorted(r.address for r in replicas.healthy()) == keys[:2]
            await _until(lambda: sorted(index.replicas) == keys[:2] and all(map(index.is_synced, keys[:2])),
                         10 * PERIOD_S)  # the prefix index: the same names, its snapshots over mTLS
            served = set()
            expected = None
            for _ in range(2):
                ids, _, last, route = await generate(router.stub, request(PROMPT, 8), AUTH)
                assert last.usage.completion_tokens == 8 and ids == (expected or ids)
                expected, served = ids, served | {route.replica}
            assert served == set(keys[:2])
            await _until(lambda: all(index.blocks(k) for k in keys[:2]), 5.0)  # their KV events, by name

            # Scale out: a third address in DNS is a replica within one period, and is used.
            hosts.add(machines[2].address, POOL)
            joined = await _until(lambda: keys[2] in {r.address for r in replicas.healthy()}, 3 * PERIOD_S)
            assert joined <= PERIOD_S + 0.5  # one period (+ the poll's own checks)
            served = set()
            for _ in range(3):
                ids, _, _, route = await generate(router.stub, request(PROMPT, 8), AUTH)
                assert ids == expected
                served.add(route.replica)
            assert keys[2] in served
            await _until(lambda: index.is_synced(keys[2]) and index.blocks(keys[2]), 3 * PERIOD_S + 2)

            # Scale in: an address gone from DNS is ejected within one period.
            hosts.remove(machines[1].address, POOL)
            left = await _until(lambda: keys[1] not in {r.address for r in replicas.replicas}, 3 * PERIOD_S)
            assert left <= PERIOD_S + 0.5
            await _until(lambda: keys[1] not in index.replicas, 3 * PERIOD_S)
            for _ in range(2):
                _, _, _, route = await generate(router.stub, request(PROMPT, 8), AUTH)
                assert route.replica in (keys[0], keys[2])

            # A replica dies with a request on it that has not streamed: retried on the other.
            procs[0].send_signal(signal.SIGSTOP)  # frozen: the request waits there, no token
            calls = [asyncio.ensure_future(generate(router.stub, request(PROMPT, 8), AUTH))
                     for _ in range(2)]  # round robin: one of them on the frozen replica
            await asyncio.sleep(0.5)
            procs[0].kill()  # dies before its first token
            results = await asyncio.wait_for(asyncio.gather(*calls), timeout=30)
            routes = [route for _, _, _, route in results]
            assert all(ids == expected for ids, _, _, _ in results)
            assert {(r.replica, r.retried) for r in routes} == {(keys[2], False), (keys[2], True)}
            assert keys[0] not in {r.address for r in replicas.healthy()}
        finally:
            await router.stop()
            await cache.stop(grace=0.2)
    assert DOMAIN not in open("/etc/hosts").read()  # the machine is left clean
