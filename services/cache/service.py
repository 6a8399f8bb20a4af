"""gRPC CacheService: retrieval and tool result caches."""

from __future__ import annotations

import logging

import grpc
from opentelemetry import trace

from services.cache.config import CacheConfig
from services.cache.store import BackendUnavailable, ResultCache
from services.common.proto.specmesh.v1 import cache_service_pb2, cache_service_pb2_grpc

log = logging.getLogger(__name__)
tracer = trace.get_tracer("specmesh.cache")
SERVICE_NAME = cache_service_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name
_KIND_NAMES = {cache_service_pb2.CACHE_KIND_RETRIEVAL: "retrieval", cache_service_pb2.CACHE_KIND_TOOL: "tool"}


class CacheService(cache_service_pb2_grpc.CacheServiceServicer):
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.cache = ResultCache(config)

    async def Get(self, request, context: grpc.aio.ServicerContext):
        kind = await self._validate_key(request.kind, request.key, context)
        with tracer.start_as_current_span("cache.lookup") as span:
            span.set_attribute("specmesh.cache_kind", kind)
            value = await self._backend(self.cache.get(kind, request.key), context)
            span.set_attribute("specmesh.cache_hit", value is not None)
        if value is None:
            return cache_service_pb2.CacheGetResponse(found=False)
        return cache_service_pb2.CacheGetResponse(found=True, value=value)

    async def Put(self, request, context: grpc.aio.ServicerContext):
        kind = await self._validate_key(request.kind, request.key, context)
        cfg = self.config
        problems = []
        if not 0 < request.ttl_seconds <= cfg.max_ttl_seconds:
            problems.append(f"ttl_seconds {request.ttl_seconds} is out of range [1, {cfg.max_ttl_seconds}]")
        if len(request.value) > cfg.max_value_bytes:
            problems.append(f"value of {len(request.value)} bytes is above the limit of {cfg.max_value_bytes}")
        if problems:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        with tracer.start_as_current_span("cache.store") as span:
            span.set_attribute("specmesh.cache_kind", kind)
            await self._backend(self.cache.put(kind, request.key, request.value, request.ttl_seconds),
                                context)
        return cache_service_pb2.CachePutResponse()

    async def close(self) -> None:
        await self.cache.close()

    # ---- helpers ------------------------------------------------------------------------

    async def _validate_key(self, kind: int, key: str, context: grpc.aio.ServicerContext) -> str:
        """The kind's name, or aborts with INVALID_ARGUMENT."""
        problems = []
        if kind not in _KIND_NAMES:
            problems.append("kind must be CACHE_KIND_RETRIEVAL or CACHE_KIND_TOOL, got "
                            + _kind_label(kind))
        if not key:
            problems.append("key is empty")
        elif len(key.encode()) > self.config.max_key_bytes:
            problems.append(f"key is above the limit of {self.config.max_key_bytes} bytes")
        if problems:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        return _KIND_NAMES[kind]

    async def _backend(self, operation, context: grpc.aio.ServicerContext):
        """Awaits a backend operation; a failing backend answers UNAVAILABLE, a bug INTERNAL."""
        try:
            return await operation
        except BackendUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cache backend unavailable: {exc}")
        except Exception:
            log.exception("cache operation failed")
            await context.abort(grpc.StatusCode.INTERNAL, "cache operation failed")


def _kind_label(kind: int) -> str:
    try:
        return cache_service_pb2.CacheKind.Name(kind)
    except ValueError:
        return str(kind)


def add_to_server(server: grpc.aio.Server, service: CacheService) -> None:
    cache_service_pb2_grpc.add_CacheServiceServicer_to_server(service, server)
