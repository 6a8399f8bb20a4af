"""Builds the target gRPC server around a loaded engine."""

from __future__ import annotations

import asyncio
import logging

from services.common.server import GrpcServer, ServerConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.server.service import SERVICE_NAME, TargetService, add_to_server

log = logging.getLogger(__name__)


def build_target_server(server_config: ServerConfig, engine: Engine, model_name: str) -> GrpcServer:
    """Wraps a loaded engine (not yet started) in a server; the engine starts with the server.

    When the engine's loop fails (services/target/engine/engine.py `_fail`) the server turns
    NOT_SERVING at once and sets `server.engine_failed`; its runner then stops it and exits
    non-zero (`specmesh serve target`) or restarts it (`specmesh up`), services/builders.py."""
    service = TargetService(engine, model_name)
    engine_failed = asyncio.Event()
    tasks: set[asyncio.Task] = set()  # held, so that the task is not collected before it runs

    async def on_started(server: GrpcServer) -> None:
        loop = asyncio.get_running_loop()

        async def not_serving() -> None:
            await server.set_serving(False)
            engine_failed.set()

        def failed(error: Exception) -> None:  # engine thread
            log.critical("target engine failed: %s; health NOT_SERVING", error)
            loop.call_soon_threadsafe(lambda: tasks.add(loop.create_task(not_serving())))
        engine.on_failure(failed)

    async def on_stopped() -> None:
        engine.shutdown()

    server = GrpcServer(server_config, lambda s: add_to_server(s, service), [SERVICE_NAME],
                        on_drain=service.drain, on_stopped=on_stopped, on_started=on_started)
    engine.start()
    server.target_service = service  # for tests and stats
    server.engine_failed = engine_failed
    return server


def load_engine(config: EngineConfig) -> Engine:
    return Engine.load(config)
