"""`specmesh status`: health of each service, each cache instance's prefix index, the router's
pools and replicas with their KV use and queue (from the router's ListModels, which holds
each replica's last GetStats).

    service  address          state
    router   127.0.0.1:50051  SERVING
    ...
    cache 127.0.0.1:50054  prefix index: 1/1 target replicas synced, 40 entries, 52 events, 1 snapshots  backend memory
    pool default (model default)
      replica 127.0.0.1:50052  SERVING  KV 3/2048 blocks used, 1 cached, 2045 free  running 0  waiting 0  queued tokens 0
        cold KV precision auto -> off (no measured accuracy cost for this model and pool dtype), host tier ...

(the precision line only for a replica with a host tier: `precision_text`.)

`cache_address` may name several instances (a comma-separated list, and `dns:///NAME:PORT`
entries resolved as the router resolves them, services/common/dns_replicas.py): each
instance is one `cache` row, by its identity, and one line of its own `GetStats`.

Exit status 0 when every service, cache instance and replica is SERVING, else 1.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.client import router_ca
from services.common.dns_replicas import DnsReplicas
from services.router.cache_instances import cache_entries
from services.settings import Settings
from specmesh.client import NO_RETRIES, Client
from specmesh.proto.v1 import cache_service_pb2, cache_service_pb2_grpc, router_service_pb2

TIMEOUT_S = 3.0
LISTENING_TLS = "listening (mutual TLS: pass --tls-dir to check its health)"


def print_status(settings: Settings, out=None) -> int:
    import sys
    out = out or sys.stdout
    lines, ok = status_lines(settings)
    out.write("\n".join(lines) + "\n")
    return 0 if ok else 1


def status_lines(settings: Settings) -> tuple[list[str], bool]:
    router, draft, cache = _addresses(settings)
    public = _router_channel(settings, router)
    rows = [("router", router, _health(public))]
    tls = _mesh_tls(settings)
    caches, no_cache = _cache_instances(cache)
    cache_stats = []
    for name, address in [("draft", draft), *(("cache", c) for c in caches)]:
        with _internal_channel(address, tls) as channel:
            state = _health(channel)
            if name == "cache":
                cache_stats.append(f"cache {address}  {cache_line(channel)}")
        if state == "UNAVAILABLE" and tls is None and _listening(address):
            state = LISTENING_TLS  # a mutual-TLS service refuses a plaintext health check
        rows.append((name, address, state))
    if no_cache:
        rows.append(("cache", cache, no_cache))
    if settings.gateway_port:
        rows.append(("gateway", f"http://{settings.host}:{settings.gateway_port}", _http_health(settings)))
    ok = all(state in ("SERVING", "ok", "not running", "not configured", LISTENING_TLS) for _, _, state in rows)
    width = max(len(a) for _, a, _ in rows)
    lines = [f"{'service':<8} {'address':<{width}}  state"]
    lines += [f"{name:<8} {address:<{width}}  {state}" for name, address, state in rows]
    lines += cache_stats
    public.close()
    ca = router_ca(settings)
    # One attempt: status reports what the router says now, it does not wait for a better answer.
    with Client(router, settings.token, ca_pem=ca, timeout=TIMEOUT_S, retry=NO_RETRIES) as client:
        try:
            models = client.list_models()
        except grpc.RpcError as exc:
            lines.append(f"pools: the router did not answer ListModels: {exc.code().name}: {exc.details()}")
            return lines, False
    for pool in models.pools:
        lines.append(f"pool {pool.name} (model {pool.model})")
        for r in pool.replicas:
            ok = ok and r.healthy
            lines.append("  " + replica_line(r))
            if r.has_stats and r.host_tier_capacity_bytes:
                lines.append("    " + precision_text(r))
    return lines, ok


def replica_line(r: router_service_pb2.ReplicaStatus) -> str:
    state = "SERVING" if r.healthy else "NOT_SERVING"
    if not r.has_stats:
        return f"replica {r.address}  {state}  (no stats yet)"
    host = (f"  host tier {r.host_tier_bytes / 2**20:.1f}/{r.host_tier_capacity_bytes / 2**20:.1f} MiB, "
            f"{r.host_tier_restored_blocks} blocks restored" if r.host_tier_capacity_bytes else "")
    host += (f"  shared tier {r.shared_tier_bytes / 2**20:.1f}/{r.shared_tier_capacity_bytes / 2**20:.1f} MiB written, "
             f"{r.shared_tier_restored_blocks} blocks loaded" if r.shared_tier_capacity_bytes else "")
    return (f"replica {r.address}  {state}  KV {r.num_blocks - r.free_blocks}/{r.num_blocks} blocks used, "
            f"{r.cached_blocks} cached, {r.free_blocks} free{host}  running {r.running_requests}  "
            f"waiting {r.waiting_requests}  queued tokens {r.queued_tokens}")


def precision_text(r: router_service_pb2.ReplicaStatus) -> str:
    """A replica's host-tier KV precision: the setting, the policy it resolved to and why, and the
    FP8 copies held now, e.g. `cold KV precision auto -> off (no measured accuracy cost for this
    model and pool dtype), host tier holds 0 FP8 blocks (0.0 MiB)`."""
    setting, resolved = r.kv_cold_precision_setting or "?", r.kv_cold_precision or "off"
    reason = r.kv_cold_precision_reason.removeprefix(f"{setting}: ")  # the setting is shown already
    return (f"cold KV precision {setting} -> {resolved} ({reason or 'no reason reported'}), host tier holds "
            f"{r.host_tier_fp8_blocks} FP8 blocks ({r.host_tier_fp8_bytes / 2**20:.1f} MiB)")


def cache_line(channel: grpc.Channel) -> str:
    """One cache instance's GetStats, or why there are none."""
    try:
        s = cache_service_pb2_grpc.CacheServiceStub(channel).GetStats(
            cache_service_pb2.CacheServiceGetStatsRequest(), timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        return f"(no stats: {exc.code().name})"
    return (f"prefix index: {s.synced_replicas}/{s.replicas} target replicas synced, {s.index_entries} entries, "
            f"{s.events_applied} events, {s.resyncs} snapshots  backend {s.backend}")


# ---- helpers ----------------------------------------------------------------
def _cache_instances(address: str) -> tuple[list[str], str]:
    """The cache instances `cache_address` names now (dns:/// entries resolved), and the
    state to show instead when it names none."""
    try:
        entries = cache_entries(address)
    except ValueError as exc:
        return [], f"bad address: {exc}"
    if not entries:
        return [], "not configured"
    instances = asyncio.run(DnsReplicas(entries).expand())
    return instances, "" if instances else "no instance resolved"


def _addresses(settings: Settings) -> tuple[str, str, str]:
    """router, draft, cache; with `--port BASE` the layout of `specmesh up --port BASE`."""
    if settings.port:
        return tuple(f"{settings.host}:{settings.port + i}" for i in (0, 2, 3))
    return settings.router_address, settings.draft_address, settings.cache_address


def _router_channel(settings: Settings, address: str) -> grpc.Channel:
    ca = router_ca(settings)
    if ca is not None:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca))
    return grpc.insecure_channel(address)


def _mesh_tls(settings: Settings):
    """Mesh credentials to check internal services with (as the router); None = plaintext."""
    from services.builders import mesh_tls
    try:
        return mesh_tls(settings, "router")
    except (ValueError, OSError):
        return None


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def _internal_channel(address: str, tls) -> grpc.Channel:
    from services.common.tls import internal_sync_channel
    return internal_sync_channel(address, tls)


def _health(channel: grpc.Channel) -> str:
    try:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=TIMEOUT_S)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    except grpc.RpcError as exc:
        return exc.code().name


def _http_health(settings: Settings) -> str:
    try:
        with urllib.request.urlopen(f"http://{settings.host}:{settings.gateway_port}/healthz",
                                    timeout=TIMEOUT_S) as response:
            return "ok" if response.status == 200 else f"HTTP {response.status}"
    except (urllib.error.URLError, OSError):
        return "not running"
