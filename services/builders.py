"""Builds each service's validated config and server from Settings (used by the CLI): each
service gets its group of the settings tree (services/settings.py) as it is."""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import tempfile
from dataclasses import replace
from pathlib import Path

from services.common.env import DEFAULT_PORTS, DEV_SALT_SECRET, DEV_TOKEN
from services.common.server import GrpcServer, ServerConfig, check_port_free, run_until_signal
from services.common.telemetry import TelemetryConfig, serve_metrics, setup_telemetry
from services.common.tls import MeshTls, PublicTls, ServerTls, load_mesh_tls, make_dev_certs
from services.settings import Settings

log = logging.getLogger(__name__)
INTERNAL_SERVICES = ("target", "draft", "cache")  # serve only mutual TLS (unless dev plaintext)


def server_config(settings: Settings, service: str, mesh: MeshTls | None = None) -> ServerConfig:
    """Internal services serve mutual TLS with `mesh`; the router its public TLS, if configured."""
    tls: ServerTls | None = None
    if service in INTERNAL_SERVICES and mesh is not None:
        tls = mesh.server_tls()
    elif service == "router" and (settings.public_tls_cert or settings.public_tls_key):
        if not (settings.public_tls_cert and settings.public_tls_key):
            raise ValueError("public_tls_cert and public_tls_key go together")
        tls = PublicTls.from_files(settings.public_tls_cert, settings.public_tls_key).server_tls()
    return ServerConfig(host=settings.host, port=settings.port or DEFAULT_PORTS[service],
                        grace_seconds=settings.grace_seconds, tls=tls)


def mesh_tls(settings: Settings, identity: str) -> MeshTls | None:
    """`identity`'s mesh credentials from settings; None (plaintext) only in dev mode."""
    return load_mesh_tls(settings, identity)


def check_salt_secret(settings: Settings, allow_dev_token: bool = False) -> None:
    """The router refuses the public default salt secret and the public dev token outside dev mode
    (`specmesh up`, a loopback run, accepts the dev token: `allow_dev_token`)."""
    if settings.router.salt_secret == DEV_SALT_SECRET and not settings.dev:
        raise ValueError("salt_secret is the public default: set SPECMESH_SALT_SECRET to a random "
                         "value (e.g. `openssl rand -hex 32`), or pass --dev on a development machine")
    from services.router.config import parse_tokens
    if (not settings.config and DEV_TOKEN in parse_tokens(settings.router.tokens) and not settings.dev
            and not allow_dev_token):
        raise ValueError(f"tokens accept the public dev token {DEV_TOKEN!r}: set SPECMESH_TOKENS to "
                         "your own TOKEN=TENANT,... pairs, or pass --dev on a development machine")


def resolve_model(settings: Settings, model: str = "") -> Path:
    """The directory of `model` (default: the target's, `settings.model`) in the model cache."""
    from services.common.models.loading import resolve_model_dir
    return resolve_model_dir(model or settings.model, Path(settings.model_cache).expanduser())


def engine_config(settings: Settings, model_dir: Path):
    from services.target.config import EngineConfig
    speculates = settings.router.speculation_method != "off"  # the plan the router makes
    return EngineConfig(model_dir=model_dir, dtype=settings.dtype, max_tokens_limit=settings.max_tokens_limit,
                        max_samples=settings.max_samples, limits=settings.limits,
                        draft_address=settings.draft_address if speculates else "",
                        draft_timeout_s=settings.target.draft_timeout_ms / 1000,
                        **settings.target.engine_fields())


def router_config(settings: Settings, mesh: MeshTls | None = None):
    from services.router.config import RouterConfig, parse_tokens
    pools = routing_mesh(settings)
    return RouterConfig(mesh_tls=mesh, target_address=settings.target_address,
                        tokens=parse_tokens(settings.router.tokens), max_tokens_limit=settings.max_tokens_limit,
                        max_samples=settings.max_samples, limits=settings.limits,
                        cache_address=settings.cache_address, mesh=pools,
                        eagle_pools=eagle_pools(settings, pools),
                        model_cache=settings.model_cache, **settings.router.config_fields())


def eagle_pools(settings: Settings, pools) -> tuple[str, ...]:
    """The pools whose open text may run the feature head by default: those of the target
    `model` when the mesh's draft service has a head for it (`eagle_head`, refused there for
    any other model)."""
    if eagle_head(settings) is None:
        return ()
    return tuple(pool.name for pool in pools.pools if pool.model == settings.model)


def eagle_head(settings: Settings) -> Path | None:
    """The feature head file of the mesh (`draft.eagle_head`: 'auto' = the one shipped for `model`)."""
    from services.draft.eagle.shipped import resolve_eagle_head
    return resolve_eagle_head(settings.draft.eagle_head, settings.model)


def cache_config(settings: Settings, server: ServerConfig | None = None, mesh: MeshTls | None = None):
    from services.cache.config import CacheConfig
    return CacheConfig(server=server or server_config(settings, "cache"), mesh_tls=mesh,
                       replicas=cache_replicas(settings), max_memory_bytes=settings.cache.max_memory_mb << 20,
                       **settings.cache.config_fields())


def build_server(service: str, settings: Settings, config: ServerConfig | None = None,
                 allow_dev_token: bool = False) -> GrpcServer:
    """Builds one service's server (not started). The target loads its model here.

    Mesh credentials come from settings (`mesh_tls`); `config`'s port and host win when given."""
    mesh = mesh_tls(settings, service)
    default = server_config(settings, service, mesh)
    config = default if config is None else replace(config, tls=default.tls)
    if service == "router":
        from services.router.app import build_router_server
        check_salt_secret(settings, allow_dev_token)
        return build_router_server(config, router_config(settings, mesh))
    if service == "target":
        from services.target.server.app import build_target_server, load_engine
        model_dir = resolve_model(settings)
        engine = load_engine(replace(engine_config(settings, model_dir), mesh_tls=mesh))
        return build_target_server(config, engine, settings.model)
    if service == "draft":
        from services.draft.app import build_draft_server
        from services.draft.config import DraftConfig
        draft_model = settings.draft.draft_model
        draft_dir = resolve_model(settings, draft_model) if draft_model else None
        head = eagle_head(settings)
        return build_draft_server(DraftConfig(server=config, draft_model_dir=draft_dir,
                                              draft_model_dtype=settings.dtype, eagle_head_path=head,
                                              eagle_target_dir=resolve_model(settings) if head else None,
                                              eagle_optional=settings.draft.eagle_head.strip().lower() == "auto"))
    if service == "cache":
        from services.cache.app import build_cache_server
        return build_cache_server(cache_config(settings, config, mesh))
    raise ValueError(f"unknown service {service!r}; expected router, target, draft or cache")


def routing_mesh(settings: Settings):
    """The router's pools: the mesh config file's, else one pool `default` over target_address."""
    from services.common.mesh_config import default_mesh_config, load_mesh_config
    from services.router.config import parse_tokens
    if settings.config:
        return load_mesh_config(settings.config)
    addresses = [a.strip() for a in settings.target_address.split(",") if a.strip()]
    return default_mesh_config(addresses, parse_tokens(settings.router.tokens), model=settings.model)


def cache_replicas(settings: Settings) -> tuple[str, ...]:
    """Targets the cache's prefix index follows: `cache_replicas`, else every pool replica of
    the mesh config file, else `target_address` (comma-separated)."""
    listed = settings.cache.replicas
    if not listed and settings.config:
        from services.common.mesh_config import load_mesh_config
        mesh = load_mesh_config(settings.config)
        return tuple(dict.fromkeys(r for pool in mesh.pools for r in pool.replicas))
    listed = listed or settings.target_address
    return tuple(dict.fromkeys(a.strip() for a in listed.split(",") if a.strip()))


def start_metrics(service: str, host: str, port: int) -> int | None:
    """Serves the service's Prometheus /metrics on host:port (0 = none); a taken port is
    logged, not fatal (the service itself still runs). Returns the bound port."""
    if not port:
        return None
    try:
        bound = serve_metrics(service, host, port)
    except OSError as exc:
        log.error("%s: cannot serve /metrics on %s:%d: %s", service, host, port, exc)
        return None
    print(f"{service:>6} metrics on http://{host}:{bound}/metrics", flush=True)
    return bound


def gateway_config(settings: Settings, port: int | None = None):
    from services.gateway.app import GatewayConfig
    ca = Path(settings.router_ca).expanduser().read_bytes() if settings.router_ca else None
    if port is None:  # `serve gateway --port N` as for every other service; else --gateway-port
        port = settings.port or settings.gateway_port
    return GatewayConfig(host=settings.host, port=port,
                         router_address=settings.router_address, router_ca_pem=ca)


async def run_gateway(settings: Settings) -> int:
    """`specmesh serve gateway`: the OpenAI-compatible HTTP front of a running router."""
    from services.gateway.app import Gateway
    gateway = Gateway(gateway_config(settings))
    await gateway.start()
    print(f"gateway serving on http://{gateway.address}/v1 (router {settings.router_address})", flush=True)
    await run_until_signal([gateway])
    return 0


async def run_one(service: str, settings: Settings) -> int:
    """Serves until SIGTERM / SIGINT (0); a target whose engine failed exits EXIT_ENGINE_FAILED
    at once, for its supervisor (compose, k8s) to restart it."""
    if service == "gateway":
        return await run_gateway(settings)
    setup_telemetry(TelemetryConfig(settings.service_name or f"specmesh-{service}",
                                    settings.otlp_endpoint or None))
    server = build_server(service, settings)
    await server.start()
    print(f"{service} serving on {server.address}", flush=True)
    start_metrics(service, settings.host, settings.metrics_port)
    if service != "target":
        await run_until_signal([server])
        return 0
    if settings.target.fault_injection:
        arm_fault_on_sigusr1(lambda: server)
    failed = await wait_for_signal_or_failure([server])
    if failed:
        log.critical("target engine failed; exiting with status %d for a restart", EXIT_ENGINE_FAILED)
        await server.stop(grace=1.0)  # its requests have their errors already
        return EXIT_ENGINE_FAILED
    log.info("shutting down: draining in-flight requests")
    await server.stop()
    return 0


EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the target's engine loop failed (a restart clears it)


async def wait_for_signal_or_failure(targets) -> list:
    """Waits for SIGTERM / SIGINT (returns []) or for target servers whose engine failed
    (returns them; `server.engine_failed`, services/target/server/app.py)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = {asyncio.ensure_future(stop.wait()): None}
    waits.update({asyncio.ensure_future(t.engine_failed.wait()): t for t in targets})
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return [] if stop.is_set() else [waits[task] for task in done if waits[task] is not None]


def arm_fault_on_sigusr1(target) -> None:
    """`fault_injection`: SIGUSR1 arms the engine loop's fault point of `target()` (a test hook)."""
    def arm() -> None:
        log.warning("SIGUSR1: arming the engine loop fault (fault_injection is on)")
        target().target_service.engine.inject_loop_fault()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, arm)


async def run_all(settings: Settings) -> int:
    """`specmesh up`: all four services in this process on loopback.

    Ports are the defaults, or base, base+1, base+2, base+3 (router, target,
    draft, cache) when `settings.port` is set. Services talk mutual TLS with certificates
    made for this run (removed at exit) unless mesh certificates are given, or --dev asks
    for plaintext; the public default salt secret is replaced by a random one.
    """
    with tempfile.TemporaryDirectory(prefix="specmesh-certs-") as certs:
        if not (settings.tls_dir or settings.tls_ca or settings.tls_cert or settings.tls_key
                or settings.dev):
            settings.tls_dir = str(make_dev_certs(certs, hosts=[settings.host]))
            print(f"mesh certificates for this run in {certs} (removed at exit)", flush=True)
        if settings.router.salt_secret == DEV_SALT_SECRET:
            settings.router.salt_secret = secrets.token_hex(32)
        return await _run_all(settings)


async def _run_all(settings: Settings) -> int:
    name = f"{settings.service_name}-{{service}}" if settings.service_name else "specmesh-{service}"
    setup_telemetry(TelemetryConfig(name, settings.otlp_endpoint or None))
    ports = dict(DEFAULT_PORTS)
    if settings.port:
        ports = {name: settings.port + i for i, name in enumerate(("router", "target", "draft", "cache"))}
    for name in ("target", "draft", "cache"):
        setattr(settings, f"{name}_address", f"{settings.host}:{ports[name]}")
    for port in [*(ports[s] for s in ("router", "target", "draft", "cache")), settings.gateway_port]:
        check_port_free(settings.host, port)  # before the model loads: a taken port fails at once
    # `--replicas N`: more targets of the default pool after the cache port.
    extra = [ports["cache"] + i for i in range(1, settings.replicas)]
    settings.target_address = ",".join(f"{settings.host}:{p}" for p in [ports["target"], *extra])
    servers = {}
    front = []
    try:
        for i, port in enumerate(extra, start=2):  # extra replicas first: they load the model too
            servers[f"target-{i}"] = build_server("target", settings, ServerConfig(settings.host, port,
                                                                                   settings.grace_seconds))
            await servers[f"target-{i}"].start()
            print(f"target-{i} serving on {servers[f'target-{i}'].address}", flush=True)
        # The target first (it loads the model), the router last (it is the front door).
        for service in ("target", "draft", "cache", "router"):
            config = ServerConfig(settings.host, ports[service], settings.grace_seconds)
            servers[service] = build_server(service, settings, config, allow_dev_token=True)
            await servers[service].start()
            print(f"{service:>6} serving on {servers[service].address}", flush=True)
            if settings.metrics_base_port:  # router, target, draft, cache: base .. base+3
                start_metrics(service, settings.host,
                              settings.metrics_base_port + ("router", "target", "draft", "cache").index(service))
        if settings.gateway_port:
            from services.gateway.app import Gateway
            settings.router_address = servers["router"].address
            front = [Gateway(gateway_config(settings, port=settings.gateway_port))]  # not up's base port
            await front[0].start()
            print(f"gateway serving on http://{front[0].address}/v1 (OpenAI-compatible)", flush=True)
    except BaseException:  # a half-started mesh stops what it started (no stray servers, no noise)
        for server in [*front, *reversed(servers.values())]:
            await server.stop(0)
        raise
    print(f"ready: specmesh generate \"Hello\" --address {servers['router'].address}", flush=True)
    if settings.target.fault_injection:
        arm_fault_on_sigusr1(lambda: servers["target"])
    targets = ("target", *(f"target-{i}" for i in range(2, settings.replicas + 1)))
    while failed := await wait_for_signal_or_failure([servers[name] for name in targets]):
        for server in failed:  # a target whose engine failed: a fresh one on its port
            name = next(n for n in targets if servers[n] is server)
            log.critical("%s: engine failed; restarting it", name)
            await server.stop(grace=1.0)
            servers[name] = build_server("target", settings, server.config, allow_dev_token=True)
            await servers[name].start()
            print(f"{name:>6} restarted on {servers[name].address}", flush=True)
    log.info("shutting down: draining in-flight requests")
    for server in front + [servers[s] for s in ("router", *targets, "draft", "cache")]:
        await server.stop()
    return 0
