"""Builds the cache gRPC server (not started: the caller awaits `start()` and `stop()`)."""

from __future__ import annotations

from services.cache.config import CacheConfig
from services.cache.service import SERVICE_NAME, CacheService, add_to_server
from services.common.server import GrpcServer


def build_cache_server(config: CacheConfig) -> GrpcServer:
    """The backend connection is closed after the server stops."""
    service = CacheService(config)
    return GrpcServer(config.server, lambda grpc_server: add_to_server(grpc_server, service),
                      [SERVICE_NAME], on_stopped=service.close)
