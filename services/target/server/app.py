"""Builds the target gRPC server around a loaded engine."""

from __future__ import annotations

from services.common.server import GrpcServer, ServerConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.server.service import SERVICE_NAME, TargetService, add_to_server


def build_target_server(server_config: ServerConfig, engine: Engine, model_name: str) -> GrpcServer:
    """Wraps a loaded engine (not yet started) in a server; the engine starts with the server."""
    service = TargetService(engine, model_name)

    async def on_stopped() -> None:
        engine.shutdown()

    server = GrpcServer(server_config, lambda s: add_to_server(s, service), [SERVICE_NAME],
                        on_drain=service.drain, on_stopped=on_stopped)
    engine.start()
    server.target_service = service  # for tests and stats
    return server


def load_engine(config: EngineConfig) -> Engine:
    return Engine.load(config)
