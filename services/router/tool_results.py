"""The cache service's tool-result cache, offered to authenticated callers by the router.

`RouterService.LookupToolResult` / `StoreToolResult` forward to `CacheService.ToolLookup` /
`ToolStore` (the same field numbers, so the bytes as they are) as
the tenant the router authenticated (internal metadata, services/cache/identity.py), so every
key and lease is scoped by the caller's token and no request field can name another tenant.
Single flight is the cache's: the first caller of a missing (tool, version, arguments) gets a
lease and computes; concurrent callers of the same tenant wait for its stored result.
Agents use it through `specmesh.client` (`AsyncClient.cached_tool_call`).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.cache.identity import caller_metadata
from specmesh.proto.v1 import cache_service_pb2, cache_service_pb2_grpc, router_service_pb2

# Cache errors the caller sees as they are; any other becomes UNAVAILABLE.
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.FAILED_PRECONDITION}


class ToolResults:
    def __init__(self, channel_factory: Callable[[str], grpc.aio.Channel], cache_address: str) -> None:
        self._channel = channel_factory(cache_address) if cache_address else None
        self._stub = cache_service_pb2_grpc.CacheServiceStub(self._channel) if self._channel else None

    async def lookup(self, request, tenant: str, context) -> router_service_pb2.LookupToolResultResponse:
        """CacheService.ToolLookup as `tenant`, within the caller's deadline."""
        reply = await self._forward("ToolLookup", _as(cache_service_pb2.ToolLookupRequest, request),
                                    tenant, context)
        return _as(router_service_pb2.LookupToolResultResponse, reply)

    async def store(self, request, tenant: str, context) -> router_service_pb2.StoreToolResultResponse:
        """CacheService.ToolStore as `tenant`."""
        await self._forward("ToolStore", _as(cache_service_pb2.ToolStoreRequest, request), tenant, context)
        return router_service_pb2.StoreToolResultResponse()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def _forward(self, method: str, request, tenant: str, context):
        if self._stub is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the tool-result cache is not configured on this router (no cache service address)")
        remaining = context.time_remaining()
        try:
            return await getattr(self._stub, method)(
                request, metadata=caller_metadata(tenant),
                timeout=None if remaining is None else max(remaining, 0.001))
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _PASS_THROUGH:
                await context.abort(code, f"tool cache: {exc.details()}")
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"tool cache: cache service unavailable ({code.name}): {exc.details()}")


def _as(message_type, message):
    """The same bytes read as the other service's message (their field numbers are equal)."""
    return message_type.FromString(message.SerializeToString())
