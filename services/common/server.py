"""One way to run a gRPC service: grpc.aio, health, reflection, tracing, graceful shutdown."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.metrics_interceptor import MetricsInterceptor
from services.common.reflection_v1 import enable_reflection
from services.common.telemetry import server_interceptors, service_of
from services.common.tls import ServerTls

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Address and shutdown behaviour of one gRPC server."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port (tests)
    grace_seconds: float = 10.0
    # None = plaintext (dev mode and tests). Internal services: mutual TLS with the mesh CA
    # (`MeshTls.server_tls()`); the router's public port: `PublicTls.server_tls()`.
    tls: ServerTls | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")


class GrpcServer:
    """A started grpc.aio server with the standard health and reflection services.

    `register` adds the service implementations; `service_names` are the full
    names (e.g. "specmesh.v1.TargetService") reported by health and reflection.
    `on_drain` runs after health turns NOT_SERVING and before the server stops,
    so a service can refuse new work and finish what is in flight.
    """

    def __init__(self, config: ServerConfig, register: Callable[[grpc.aio.Server], None],
                 service_names: Sequence[str],
                 on_drain: Callable[[], Awaitable[None]] | None = None,
                 on_stopped: Callable[[], Awaitable[None]] | None = None,
                 on_started: Callable[["GrpcServer"], Awaitable[None]] | None = None,
                 max_message_bytes: int | None = None) -> None:
        self.config = config
        self._service_names = list(service_names)
        self._on_drain = on_drain
        self._on_stopped = on_stopped
        self._on_started = on_started  # e.g. the router's watch of its targets' health
        options = []
        if max_message_bytes is not None:  # gRPC's default limit on received messages is 4 MiB
            options.append(("grpc.max_receive_message_length", max_message_bytes))
        tls_interceptors = config.tls.interceptors() if config.tls is not None else []
        service = service_of(self._service_names)  # router / target / draft / cache
        self._server = grpc.aio.server(
            interceptors=[*tls_interceptors, *server_interceptors(service), MetricsInterceptor(service)],
            options=options)
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        register(self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        enable_reflection(self._server, [*self._service_names, health.SERVICE_NAME])  # v1 and v1alpha
        check_port_free(config.host, config.port)
        if config.tls is None:
            self.port = self._server.add_insecure_port(f"{config.host}:{config.port}")
        else:
            self.port = self._server.add_secure_port(f"{config.host}:{config.port}",
                                                     config.tls.credentials())
        if self.port == 0:
            raise OSError(f"could not bind {config.host}:{config.port}")
        self._stopping = False

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        await self._server.start()
        for name in ["", *self._service_names]:
            await self._set_health(name, health_pb2.HealthCheckResponse.SERVING)
        if self._on_started is not None:
            await self._on_started(self)

    async def set_serving(self, serving: bool) -> None:
        """Health SERVING or NOT_SERVING for every name (e.g. while no dependency is
        reachable); ignored once stopping, which stays NOT_SERVING."""
        if self._stopping:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._service_names]:
            await self._set_health(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first, then drain in-flight work within the grace period, then stop."""
        if self._stopping:
            return
        self._stopping = True
        grace = self.config.grace_seconds if grace is None else grace
        for name in ["", *self._service_names]:
            await self._set_health(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._on_drain is not None:
            try:
                await asyncio.wait_for(self._on_drain(), timeout=grace)
            except asyncio.TimeoutError:
                log.warning("drain did not finish within %.1fs; stopping anyway", grace)
        await self._server.stop(grace)
        if self._on_stopped is not None:
            await self._on_stopped()

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()

    async def _set_health(self, name: str, status: int) -> None:
        result = self._health.set(name, status)
        if asyncio.iscoroutine(result):
            await result


async def run_until_signal(servers: Sequence[GrpcServer]) -> None:
    """Blocks until SIGTERM or SIGINT, then stops all servers gracefully (first signal)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining in-flight requests")
    # Stop front to back: the first server (router) stops taking work first.
    for server in servers:
        await server.stop()


def check_port_free(host: str, port: int) -> None:
    """Raises OSError with a one-line reason when host:port cannot be bound. gRPC binds with
    SO_REUSEPORT, so a second server on a taken port would otherwise share it silently (or
    fail with a C-level log line and a bare RuntimeError)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As gRPC does: a port whose old connections linger in TIME_WAIT (a restart) is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {reason} "
                                     "(another specmesh running? pick another --port)") from None
