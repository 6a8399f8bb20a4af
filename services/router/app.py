"""Builds the router gRPC server."""

from __future__ import annotations

from services.common.server import GrpcServer, ServerConfig
from services.router.config import RouterConfig
from services.router.service import SERVICE_NAME, RouterService, add_to_server


class RouterServer(GrpcServer):
    """A GrpcServer that polls its replicas (and loads the pools' tokenizers) before serving."""

    def __init__(self, server_config: ServerConfig, service: RouterService) -> None:
        super().__init__(server_config, lambda s: add_to_server(s, service), [SERVICE_NAME],
                         on_drain=service.drain, on_stopped=service.close,
                         on_started=service.health_watch.start)
        self.service = service

    async def start(self) -> None:
        await self.service.start()
        await super().start()


def build_router_server(server_config: ServerConfig, config: RouterConfig) -> GrpcServer:
    return RouterServer(server_config, RouterService(config))
