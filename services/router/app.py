"""Builds the router gRPC server."""

from __future__ import annotations

from services.common.server import GrpcServer, ServerConfig
from services.router.config import RouterConfig
from services.router.service import SERVICE_NAME, RouterService, add_to_server


def build_router_server(server_config: ServerConfig, config: RouterConfig) -> GrpcServer:
    service = RouterService(config)
    return GrpcServer(server_config, lambda s: add_to_server(s, service), [SERVICE_NAME],
                      on_drain=service.drain, on_stopped=service.close)
