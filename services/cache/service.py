"""gRPC CacheService: prefix index, tool-result cache, retrieval, tenant-scoped Get/Put.

Every RPC but PrefixMatch acts for the tenant in the call's metadata
(services/cache/identity.py); inputs are checked before any backend call, so bad
input stores nothing. Backend failures answer UNAVAILABLE naming the backend.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import quote

import grpc
from opentelemetry import trace

from services.common.errors import guard_malformed
from services.cache import metrics
from services.cache.backend import BackendUnavailable, make_backend
from services.cache.config import CacheConfig
from services.cache.identity import Caller, MissingIdentity, caller_from_metadata
from services.cache.kv_subscriber import KVSubscribers
from services.common.dns_replicas import DnsReplicas
from services.cache.prefix_index import PrefixIndex
from services.cache.retrieval import Corpora, Document
from services.cache.tool_cache import (
    LEASE_GRANTED,
    WAITED,
    InvalidInput,
    LeaseLost,
    ToolCache,
    WaitTimeout,
    lease_ms_of,
    tool_key,
    wait_seconds_of,
)
from specmesh.proto.v1 import cache_service_pb2 as pb
from specmesh.proto.v1 import cache_service_pb2_grpc

log = logging.getLogger(__name__)
tracer = trace.get_tracer("specmesh.cache")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheService"].full_name
_KIND_NAMES = {pb.CACHE_KIND_RETRIEVAL: "retrieval", pb.CACHE_KIND_TOOL: "tool"}
_OUTCOMES = {"hit": pb.TOOL_LOOKUP_OUTCOME_HIT, LEASE_GRANTED: pb.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED,
             WAITED: pb.TOOL_LOOKUP_OUTCOME_WAITED}
_LOOKUP_LABEL = {"hit": "hit", LEASE_GRANTED: "miss", WAITED: "wait"}


class CacheService(cache_service_pb2_grpc.CacheServiceServicer):
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.backend = make_backend(config)
        found = DnsReplicas(config.replicas)  # dns:/// entries: followed as DNS names them
        self.index = PrefixIndex(found.listed())
        self.subscribers = KVSubscribers(self.index, config.mesh_tls, entries=found.entries)
        self.tools = ToolCache(config, self.backend)
        self.corpora = Corpora(config, self.backend)
        metrics.register_index(self.index)

    async def start(self) -> None:
        """Starts following the replicas' KV events (needs the running event loop)."""
        self.subscribers.start()

    async def close(self) -> None:
        await self.subscribers.stop()
        await self.backend.close()

    # ---- prefix index -----------------------------------------------------------------------

    async def PrefixMatch(self, request, context: grpc.aio.ServicerContext):
        if len(request.block_hashes) > self.config.max_prefix_blocks:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.block_hashes)} block hashes is above the limit of "
                                f"{self.config.max_prefix_blocks}")
        with tracer.start_as_current_span("cache.prefix_match") as span:
            start = time.perf_counter()
            matches = self.index.match(list(request.block_hashes), list(request.replicas))
            best = max((m.matched_blocks for m in matches), default=0)
            metrics.record_prefix_match(time.perf_counter() - start, best)
            span.set_attribute("specmesh.prefix_query_blocks", len(request.block_hashes))
            span.set_attribute("specmesh.prefix_hit_blocks", best)
            metrics.count_lookup("prefix", "hit" if best else "miss")
        return pb.PrefixMatchResponse(matches=[
            pb.ReplicaPrefixMatch(replica=m.replica, matched_blocks=m.matched_blocks, synced=m.synced,
                                  host_blocks=m.host_blocks, shared_blocks=m.shared_blocks)
            for m in matches])

    async def GetStats(self, request, context: grpc.aio.ServicerContext):
        index = self.index
        return pb.CacheServiceGetStatsResponse(
            replicas=len(index.replicas), synced_replicas=sum(map(index.is_synced, index.replicas)),
            index_entries=index.size, events_applied=index.events_applied, resyncs=index.resyncs,
            backend=self.config.backend)

    # ---- tool results -------------------------------------------------------------------------

    async def ToolLookup(self, request, context: grpc.aio.ServicerContext):
        caller = await self._caller(context)
        with tracer.start_as_current_span("cache.tool_lookup") as span:
            span.set_attribute("specmesh.tool", request.tool[:64])
            key, lease_ms = await self._checked(context, lambda: (
                tool_key(self.config, caller.tenant, request.tool, request.tool_version,
                         request.arguments_json),
                lease_ms_of(self.config, request.lease_ms)))
            wait = wait_seconds_of(self.config, context.time_remaining())
            result = await self._backend(self.tools.lookup(key, lease_ms, wait), context)
            span.set_attribute("specmesh.cache_outcome", result.outcome)
            metrics.count_lookup("tool", _LOOKUP_LABEL[result.outcome])
        return pb.ToolLookupResponse(outcome=_OUTCOMES[result.outcome], value=result.value,
                                     is_error=result.error is not None,
                                     error_message=result.error or "", lease_id=result.lease_id)

    async def ToolStore(self, request, context: grpc.aio.ServicerContext):
        caller = await self._caller(context)
        cfg = self.config

        def check():
            key = tool_key(cfg, caller.tenant, request.tool, request.tool_version, request.arguments_json)
            problems = []
            which = request.WhichOneof("result")
            if which is None:
                problems.append("set value or error_message")
            size = len(request.value) if which == "value" else len(request.error_message.encode())
            if size > cfg.max_value_bytes:
                problems.append(f"result of {size} bytes is above the limit of {cfg.max_value_bytes}")
            if not 0 <= request.ttl_seconds <= cfg.max_ttl_seconds:
                problems.append(f"ttl_seconds {request.ttl_seconds} is out of range [0, {cfg.max_ttl_seconds}]")
            if problems:
                raise InvalidInput("; ".join(problems))
            return key, which

        key, which = await self._checked(context, check)
        ttl = request.ttl_seconds or cfg.tool_ttl_seconds
        try:
            await self._backend(self.tools.store(
                key, request.lease_id, request.value if which == "value" else None,
                request.error_message if which == "error_message" else None, ttl), context)
        except LeaseLost as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.ToolStoreResponse()

    # ---- retrieval --------------------------------------------------------------------------

    async def Ingest(self, request, context: grpc.aio.ServicerContext):
        caller = await self._caller(context)
        documents = [Document(d.id, d.text, d.version, tuple(sorted(set(d.labels))))
                     for d in request.documents]
        version, total = await self._retrieval(
            context, self.corpora.ingest(caller.tenant, request.corpus, documents))
        return pb.IngestResponse(corpus_version=version, num_documents=total)

    async def DeleteDocuments(self, request, context: grpc.aio.ServicerContext):
        caller = await self._caller(context)
        version, deleted = await self._retrieval(
            context, self.corpora.delete(caller.tenant, request.corpus, list(request.ids)))
        return pb.DeleteDocumentsResponse(corpus_version=version, deleted=deleted)

    async def Retrieve(self, request, context: grpc.aio.ServicerContext):
        caller = await self._caller(context)
        with tracer.start_as_current_span("cache.retrieve") as span:
            span.set_attribute("specmesh.retrieval_k", request.k)
            found = await self._retrieval(
                context, self.corpora.retrieve(caller, request.corpus, request.query, request.k))
            span.set_attribute("specmesh.cache_hit", found.cache_hit)
            span.set_attribute("specmesh.retrieved_documents", len(found.documents))
            metrics.count_lookup("retrieval", "hit" if found.cache_hit else "miss")
        return pb.RetrieveResponse(
            cache_hit=found.cache_hit, corpus_version=found.corpus_version,
            documents=[pb.RetrievedDocument(score=s, document=pb.Document(
                id=d.id, text=d.text, version=d.version, labels=list(d.labels)))
                for d, s in found.documents])

    # ---- tenant-scoped Get / Put --------------------------------------------------------------

    async def Get(self, request, context: grpc.aio.ServicerContext):
        caller = await self._caller(context)
        key = await self._plain_key(caller, request.kind, request.key, context)
        with tracer.start_as_current_span("cache.lookup") as span:
            span.set_attribute("specmesh.cache_kind", _KIND_NAMES[request.kind])
            value = await self._backend(self.backend.get(key), context)
            span.set_attribute("specmesh.cache_hit", value is not None)
        if value is None:
            return pb.CacheServiceGetResponse(found=False)
        return pb.CacheServiceGetResponse(found=True, value=value)

    async def Put(self, request, context: grpc.aio.ServicerContext):
        caller = await self._caller(context)
        key = await self._plain_key(caller, request.kind, request.key, context)
        cfg = self.config
        problems = []
        if not 0 < request.ttl_seconds <= cfg.max_ttl_seconds:
            problems.append(f"ttl_seconds {request.ttl_seconds} is out of range [1, {cfg.max_ttl_seconds}]")
        if len(request.value) > cfg.max_value_bytes:
            problems.append(f"value of {len(request.value)} bytes is above the limit of {cfg.max_value_bytes}")
        if problems:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        with tracer.start_as_current_span("cache.store") as span:
            span.set_attribute("specmesh.cache_kind", _KIND_NAMES[request.kind])
            await self._backend(self.backend.set(key, request.value, request.ttl_seconds * 1000), context)
        return pb.CacheServicePutResponse()

    # ---- helpers ------------------------------------------------------------------------

    async def _caller(self, context) -> Caller:
        try:
            return caller_from_metadata(context.invocation_metadata())
        except MissingIdentity as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    async def _plain_key(self, caller: Caller, kind: int, key: str, context) -> str:
        """`<namespace>:t:<tenant>:<kind>:<key>`, or aborts with INVALID_ARGUMENT."""
        problems = []
        if kind not in _KIND_NAMES:
            problems.append("kind must be CACHE_KIND_RETRIEVAL or CACHE_KIND_TOOL, got " + _kind_label(kind))
        if not key:
            problems.append("key is empty")
        elif len(key.encode()) > self.config.max_key_bytes:
            problems.append(f"key is above the limit of {self.config.max_key_bytes} bytes")
        if problems:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        return ":".join((self.config.namespace, "t", quote(caller.tenant, safe=""), _KIND_NAMES[kind], key))

    async def _checked(self, context, check):
        try:
            return check()
        except InvalidInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _retrieval(self, context, operation):
        try:
            return await self._backend(operation, context)
        except InvalidInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _backend(self, operation, context: grpc.aio.ServicerContext):
        """Awaits a backend operation; a failing backend answers UNAVAILABLE, a bug INTERNAL."""
        try:
            return await operation
        except BackendUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cache backend unavailable: {exc}")
        except WaitTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except (InvalidInput, LeaseLost):
            raise
        except Exception:
            log.exception("cache operation failed")
            await context.abort(grpc.StatusCode.INTERNAL, "cache operation failed")


def _kind_label(kind: int) -> str:
    try:
        return pb.CacheKind.Name(kind)
    except ValueError:
        return str(kind)


def add_to_server(server: grpc.aio.Server, service: CacheService) -> None:
    cache_service_pb2_grpc.add_CacheServiceServicer_to_server(service, guard_malformed(server))
