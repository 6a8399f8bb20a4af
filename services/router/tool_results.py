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

import grpc

from services.cache.config import CacheConfig
from services.cache.identity import caller_metadata
from services.cache.tool_cache import canonical_arguments
from services.router.cache_instances import CacheInstances, NoCacheInstance, shard_key
from specmesh.proto.v1 import cache_service_pb2, router_service_pb2

# Cache errors the caller sees as they are; any other becomes UNAVAILABLE.
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.FAILED_PRECONDITION}
# Arguments above the cache's default limit are refused there; not parsed here.
_CANONICAL_MAX_BYTES = CacheConfig.__dataclass_fields__["max_arguments_bytes"].default


class ToolResults:
    def __init__(self, cache: CacheInstances | None) -> None:
        self._cache = cache  # the service's; a call goes to the instance owning its key

    async def lookup(self, request, tenant: str, context) -> router_service_pb2.LookupToolResultResponse:
        """CacheService.ToolLookup as `tenant`, within the caller's deadline."""
        reply = await self._forward("ToolLookup", _as(cache_service_pb2.ToolLookupRequest, request),
                                    tenant, context)
        return _as(router_service_pb2.LookupToolResultResponse, reply)

    async def store(self, request, tenant: str, context) -> router_service_pb2.StoreToolResultResponse:
        """CacheService.ToolStore as `tenant`."""
        await self._forward("ToolStore", _as(cache_service_pb2.ToolStoreRequest, request), tenant, context)
        return router_service_pb2.StoreToolResultResponse()

    async def _forward(self, method: str, request, tenant: str, context):
        if self._cache is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the tool-result cache is not configured on this router (no cache service address)")
        remaining = context.time_remaining()
        try:
            return await self._cache.call(
                tool_shard_key(tenant, request.tool, request.tool_version, request.arguments_json), method,
                request, metadata=caller_metadata(tenant),
                timeout=None if remaining is None else max(remaining, 0.001))
        except NoCacheInstance as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"tool cache: {exc}")
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _PASS_THROUGH:
                await context.abort(code, f"tool cache: {exc.details()}")
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"tool cache: cache service unavailable ({code.name}): {exc.details()}")


def tool_shard_key(tenant: str, tool: str, version: str, arguments_json: str) -> bytes:
    """The cache's own key of a tool call (its canonical arguments): a lookup and its store, and
    equal calls spelled differently, go to one instance. Arguments the cache refuses (not JSON,
    too large) are keyed as they come; the owner refuses them as any instance would."""
    arguments = arguments_json
    if len(arguments_json.encode()) <= _CANONICAL_MAX_BYTES:
        try:
            arguments = canonical_arguments(arguments_json)
        except (ValueError, RecursionError):
            pass
    return shard_key("tool", tenant, tool, version, arguments)


def _as(message_type, message):
    """The same bytes read as the other service's message (their field numbers are equal)."""
    return message_type.FromString(message.SerializeToString())
