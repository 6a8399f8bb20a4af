"""Builds the cache gRPC server (not started: the caller awaits `start()` and `stop()`)."""

from __future__ import annotations

from services.cache.config import CacheConfig
from services.cache.service import SERVICE_NAME, CacheService, add_to_server
from services.common.server import GrpcServer


def build_cache_server(config: CacheConfig) -> GrpcServer:
    """The backend connection is closed after the server stops."""
    service = CacheService(config)
    return GrpcServer(config.server, lambda grpc_server: add_to_server(grpc_server, service),
                      [SERVICE_NAME], on_stopped=service.close,
                      # Room for the largest allowed value plus the key and framing, so an
                      # oversized value gets our INVALID_ARGUMENT, not gRPC's size error.
                      max_message_bytes=config.max_value_bytes + config.max_key_bytes + 64 * 1024)
