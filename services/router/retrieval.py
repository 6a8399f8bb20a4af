"""Retrieval-augmented generation on the router's request path.

For a request with a retrieval part, the router asks the cache service for the top-k
documents of the tenant's corpus (as the authenticated tenant, with its access
labels), then builds the final prompt from one fixed template: the documents in
canonical order (id, then version) before the question. Equal document sets thus make
an equal prompt prefix, which the target's prefix cache reuses across questions.
The final response carries a report: documents used, retrieval cache hit, and prompt
tokens served from the prefix cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping

import grpc
from opentelemetry import trace

from services.cache.identity import caller_metadata
from services.common import instruments, metrics
from services.router.cache_instances import CacheInstances, NoCacheInstance, shard_key
from specmesh.proto.v1 import cache_service_pb2, router_service_pb2

DEFAULT_K = 4
MAX_K = 20
DEFAULT_QUERY_CHARS = 2000  # a query defaulting to the prompt uses its first characters
HEADER = "Answer the question using the documents below.\n\n"
DOCUMENT = "[document {id} v{version}]\n{text}\n\n"
QUESTION = "Question: {question}\nAnswer:"


def build_prompt(documents, question: str) -> str:
    """The fixed template; `documents` are (id, version, text) in any order."""
    ordered = sorted(documents, key=lambda d: (d[0], d[1]))
    return HEADER + "".join(DOCUMENT.format(id=i, version=v, text=t) for i, v, t in ordered) \
        + QUESTION.format(question=question)


class Augmented:
    """One request's retrieval outcome; `report` goes on the final response."""

    def __init__(self, prompt: str, report: router_service_pb2.RetrievalReport) -> None:
        self.prompt = prompt
        self.report = report

    async def annotate(self, responses: AsyncIterator) -> AsyncIterator:
        """Passes responses through; the final one (with usage) gets the retrieval report."""
        async for response in responses:
            if response.chunk.HasField("usage"):
                self.report.cached_prompt_tokens = response.chunk.usage.cached_prompt_tokens
                response.retrieval.CopyFrom(self.report)
                instruments.counter("router", metrics.SAVED_PREFILL_TOKENS).add(
                    self.report.cached_prompt_tokens, {"specmesh.cache.kind": "retrieval"})
            yield response


def annotate(augmented: Augmented | None, responses: AsyncIterator) -> AsyncIterator:
    """`responses`, with the retrieval report on the final one when there was retrieval."""
    return responses if augmented is None else augmented.annotate(responses)


def tenant_labels(mesh) -> Callable[[str], tuple[str, ...]]:
    """A tenant's access labels from the mesh config (none for unknown tenants)."""
    def labels(tenant: str) -> tuple[str, ...]:
        config = mesh.tenant(tenant) if mesh is not None else None
        return config.access_labels if config is not None else ()
    return labels


class Retrieval:
    def __init__(self, cache: CacheInstances | None,
                 access_labels: Callable[[str], tuple[str, ...]] | Mapping[str, tuple[str, ...]]) -> None:
        self._cache = cache  # the service's; a corpus goes to the instance owning (tenant, corpus)
        self._labels = access_labels if callable(access_labels) else (lambda t: access_labels.get(t, ()))

    async def augment(self, request, tenant: str, context: grpc.aio.ServicerContext) -> Augmented | None:
        """None without a retrieval part; else rewrites `request.prompt` and returns the report.

        Aborts with INVALID_ARGUMENT (bad retrieval part, unknown corpus) or UNAVAILABLE."""
        if not request.HasField("retrieval"):
            return None
        spec = request.retrieval
        k = spec.k or DEFAULT_K
        problems = []
        if not spec.corpus:
            problems.append("retrieval.corpus is empty")
        if not 1 <= k <= MAX_K:
            problems.append(f"retrieval.k {spec.k} is out of range [1, {MAX_K}]")
        if not request.prompt.strip():
            problems.append("retrieval needs a prompt (the question), not messages")
        if problems:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        query = spec.query or request.prompt[:DEFAULT_QUERY_CHARS]
        reply = await self._forward("Retrieve", cache_service_pb2.RetrieveRequest(
            corpus=spec.corpus, query=query, k=k), tenant, spec.corpus, context)
        docs = sorted(((r.document.id, r.document.version, r.document.text) for r in reply.documents),
                      key=lambda d: (d[0], d[1]))
        request.prompt = build_prompt(docs, request.prompt)
        span = trace.get_current_span()
        span.set_attribute("specmesh.retrieval.documents", len(docs))
        span.set_attribute("specmesh.retrieval.cache_hit", reply.cache_hit)
        return Augmented(request.prompt, router_service_pb2.RetrievalReport(
            documents=[router_service_pb2.RetrievedDocumentRef(id=i, version=v) for i, v, _ in docs],
            cache_hit=reply.cache_hit, corpus_version=reply.corpus_version))

    async def ingest(self, request, tenant: str, context) -> router_service_pb2.IngestDocumentsResponse:
        """Forwards IngestDocuments to the cache service as `tenant`."""
        reply = await self._forward("Ingest", cache_service_pb2.IngestRequest(
            corpus=request.corpus, documents=request.documents), tenant, request.corpus, context)
        return router_service_pb2.IngestDocumentsResponse(corpus_version=reply.corpus_version,
                                                          num_documents=reply.num_documents)

    async def remove(self, request, tenant: str, context) -> router_service_pb2.RemoveDocumentsResponse:
        """Forwards RemoveDocuments to the cache service as `tenant`."""
        reply = await self._forward("DeleteDocuments", cache_service_pb2.DeleteDocumentsRequest(
            corpus=request.corpus, ids=request.ids), tenant, request.corpus, context)
        return router_service_pb2.RemoveDocumentsResponse(corpus_version=reply.corpus_version,
                                                          removed=reply.deleted)

    async def _forward(self, method: str, message, tenant: str, corpus: str, context):
        """Calls the cache service's `method` as `tenant` (with its labels) within the caller's
        deadline, on the instance owning (tenant, corpus); its errors become the caller's
        INVALID_ARGUMENT / DEADLINE_EXCEEDED / UNAVAILABLE."""
        if self._cache is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "retrieval is not configured on this router (no cache service address)")
        remaining = context.time_remaining()
        try:
            return await self._cache.call(
                shard_key("corpus", tenant, corpus), method, message,
                metadata=caller_metadata(tenant, self._labels(tenant)),
                timeout=None if remaining is None else max(remaining, 0.001))
        except NoCacheInstance as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"retrieval: {exc}")
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED):
                await context.abort(code, f"retrieval: {exc.details()}")
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"retrieval: cache service unavailable ({code.name}): {exc.details()}")
