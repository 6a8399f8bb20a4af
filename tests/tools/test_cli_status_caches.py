"""`specmesh status` with several cache instances: `cache_address` as a list and as a
`dns:///NAME:PORT` entry (two real cache servers on loopback, each following one target
address that never answers): one row and one GetStats line per instance, by its identity;
an instance that stops shows as UNAVAILABLE and fails the status."""

from __future__ import annotations

import asyncio
import os

import pytest

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.common.server import ServerConfig
from services.settings import read_settings
from services.status import status_lines
from tests.netns import Hosts
from tests.processes import free_port

DOMAIN = "status-caches.specmesh.test"
NOBODY = "127.0.0.1:9"  # the target address the instances' prefix indexes follow (discard port)
STATS = "prefix index: 0/1 target replicas synced, 0 entries, 0 events, 0 snapshots  backend memory"


async def _caches(hosts_and_port: list[tuple[str, int]]):
    servers = [build_cache_server(CacheConfig(server=ServerConfig(host=host, port=port), replicas=(NOBODY,)))
               for host, port in hosts_and_port]
    for server in servers:
        await server.start()
    return servers


async def _status(cache_address: str) -> tuple[list[str], bool]:
    settings = read_settings({}, dev=True, router_address=f"127.0.0.1:{free_port()}",
                             draft_address=f"127.0.0.1:{free_port()}", cache_address=cache_address)
    return await asyncio.to_thread(status_lines, settings)  # blocking calls; the servers run here


def _cache_lines(lines: list[str]) -> list[str]:
    return [" ".join(line.split()) for line in lines if line.startswith("cache")]


async def test_a_list_of_cache_addresses_is_one_row_and_stats_line_each():
    a, b = await _caches([("127.0.0.1", 0), ("127.0.0.1", 0)])
    try:
        lines, ok = await _status(f"{a.address}, {b.address}")
        assert _cache_lines(lines) == [f"cache {a.address} SERVING", f"cache {b.address} SERVING",
                                       f"cache {a.address} {' '.join(STATS.split())}",
                                       f"cache {b.address} {' '.join(STATS.split())}"]
        assert not ok  # no router runs here
        await b.stop(grace=0.1)
        lines, _ = await _status(f"{a.address},{b.address}")
        assert _cache_lines(lines)[1] == f"cache {b.address} UNAVAILABLE"
        assert _cache_lines(lines)[3] == f"cache {b.address} (no stats: UNAVAILABLE)"
    finally:
        await a.stop(grace=0.1)


@pytest.mark.skipif(os.geteuid() != 0, reason="writes /etc/hosts (needs root)")
async def test_a_dns_entry_is_each_resolved_instance_by_its_own_name():
    port = free_port()
    names = [f"cache-{i}.{DOMAIN}" for i in range(2)]
    with Hosts() as hosts:
        for i, name in enumerate(names):
            hosts.add(f"127.0.0.{31 + i}", name)  # the pod's own name first: its reverse name
        for i in range(2):
            hosts.add(f"127.0.0.{31 + i}", f"caches.{DOMAIN}")  # the headless Service
        servers = await _caches([(f"127.0.0.{31 + i}", port) for i in range(2)])
        try:
            lines, _ = await _status(f"dns:///caches.{DOMAIN}:{port}")
            assert _cache_lines(lines) == [*(f"cache {n}:{port} SERVING" for n in names),
                                           *(f"cache {n}:{port} {' '.join(STATS.split())}" for n in names)]
            hosts.remove("127.0.0.31", f"caches.{DOMAIN}")  # scaled in
            lines, _ = await _status(f"dns:///caches.{DOMAIN}:{port}")
            assert [line.split()[1] for line in _cache_lines(lines)] == [f"{names[1]}:{port}"] * 2
        finally:
            for server in servers:
                await server.stop(grace=0.1)
    lines, ok = await _status(f"dns:///caches.{DOMAIN}:{port}")
    assert _cache_lines(lines) == [f"cache dns:///caches.{DOMAIN}:{port} no instance resolved"] and not ok
