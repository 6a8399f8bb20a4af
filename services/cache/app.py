"""Builds the cache gRPC server (not started: the caller awaits `start()` and `stop()`)."""

from __future__ import annotations

from services.cache.config import CacheConfig
from services.cache.service import SERVICE_NAME, CacheService, add_to_server
from services.common.server import GrpcServer


class CacheServer(GrpcServer):
    """A GrpcServer that also follows the replicas' KV events while it runs."""

    def __init__(self, config: CacheConfig, service: CacheService) -> None:
        super().__init__(config.server, lambda grpc_server: add_to_server(grpc_server, service),
                         [SERVICE_NAME], on_stopped=service.close,
                         # Room for the largest allowed value plus the key and framing, so an
                         # oversized value gets our INVALID_ARGUMENT, not gRPC's size error.
                         max_message_bytes=config.max_value_bytes + config.max_key_bytes + 64 * 1024)
        self.service = service

    async def start(self) -> None:
        await super().start()
        await self.service.start()


def build_cache_server(config: CacheConfig) -> CacheServer:
    """The backend connection and the KV event subscriptions end after the server stops."""
    return CacheServer(config, CacheService(config))
