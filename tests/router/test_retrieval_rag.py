"""Retrieval-augmented generation through the router: real target, cache and router on loopback."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.common.mesh_config import TenantConfig, default_mesh_config
from specmesh.proto.v1 import cache_service_pb2 as cpb
from specmesh.proto.v1 import router_service_pb2, router_service_pb2_grpc
from services.common.server import ServerConfig
from services.router.app import build_router_server
from services.router.config import RouterConfig
from services.router.retrieval import build_prompt
from services.target.server.app import build_target_server
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from tests.mesh import AUTH_A, AUTH_B, TOKEN_A, TOKEN_B, collect, request

BLOCK = 4
DOCS = {
    "d1": "The cat eats fish every morning and sleeps in the sun.",
    "d2": "A cat of the house likes warm milk and the old red chair.",
    "d3": "Dogs bark at the mail carrier.",
    "hr-1": "The cat budget is secret: ten thousand for the cat food.",
}


@pytest.fixture
async def mesh(tiny_llama_dir):
    engine = Engine.load(EngineConfig(model_dir=tiny_llama_dir, dtype="float32", num_blocks=256,
                                      block_size=BLOCK, max_batched_tokens=64, max_tokens_limit=256,
                                      kernels="reference"))
    target = build_target_server(ServerConfig(port=0), engine, "tiny")
    await target.start()
    cache = build_cache_server(CacheConfig(replicas=(target.address,)))
    await cache.start()
    tokens = {TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"}
    base = default_mesh_config([target.address], tokens, model=str(tiny_llama_dir))
    mesh_config = replace(base, tenants=(TenantConfig("tenant-a", TOKEN_A, access_labels=("staff",)),
                                         TenantConfig("tenant-b", TOKEN_B)))
    router = build_router_server(ServerConfig(port=0), RouterConfig(
        target_address=target.address, tokens=tokens, max_tokens_limit=256, speculation_method="off",
        speculation_policy="fixed",
        mesh=mesh_config, cache_address=cache.address))
    await router.start()
    async with grpc.aio.insecure_channel(router.address) as channel:
        ingested = await router_service_pb2_grpc.RouterServiceStub(channel).IngestDocuments(
            router_service_pb2.IngestDocumentsRequest(corpus="kb", documents=[
                cpb.Document(id=i, text=t, version=3, labels=["hr"] if i.startswith("hr") else [])
                for i, t in DOCS.items()]), metadata=AUTH_A)
        assert (ingested.corpus_version, ingested.num_documents) == (1, 4)
        yield engine, channel
    await router.stop(0)
    await cache.stop(0)
    await target.stop(0)


def rag(prompt: str, query: str = "", k: int = 2, corpus: str = "kb") -> router_service_pb2.GenerateRequest:
    req = request(prompt, 2)
    req.retrieval.CopyFrom(router_service_pb2.RetrievalSpec(corpus=corpus, query=query, k=k))
    return req


async def generate(channel, req, metadata=AUTH_A) -> router_service_pb2.GenerateResponse:
    """Runs one call; returns the final response (chunk with usage, retrieval report)."""
    last = None
    async for response in router_service_pb2_grpc.RouterServiceStub(channel).Generate(req, metadata=metadata):
        last = response
    return last


async def test_same_documents_different_questions_reuse_the_document_prefix(mesh):
    engine, channel = mesh
    first = await generate(channel, rag("What does the cat eat?", query="cat"))
    second = await generate(channel, rag("Where does the cat sleep?", query="cat"))
    assert [(d.id, d.version) for d in first.retrieval.documents] == [("d1", 3), ("d2", 3)]
    assert [(d.id, d.version) for d in second.retrieval.documents] == [("d1", 3), ("d2", 3)]
    assert (first.retrieval.cache_hit, second.retrieval.cache_hit) == (False, True)
    # The document part of the prompt (header + documents in canonical order), in whole blocks.
    prefix = build_prompt([(i, 3, DOCS[i]) for i in ("d2", "d1")], "").removesuffix("Question: \nAnswer:")
    prefix_blocks = len(engine.tokenize(prefix)) // BLOCK
    assert prefix_blocks >= 10
    usage = second.chunk.usage
    print(f"document prefix {prefix_blocks} blocks; second request: {usage.cached_prompt_tokens} of "
          f"{usage.prompt_tokens} prompt tokens cached")
    assert usage.cached_prompt_tokens >= prefix_blocks * BLOCK
    assert second.retrieval.cached_prompt_tokens == usage.cached_prompt_tokens
    assert usage.cached_prompt_tokens < usage.prompt_tokens


async def test_query_defaults_to_the_prompt_and_labels_come_from_the_tenant(mesh):
    _, channel = mesh
    reply = await generate(channel, rag("cat budget cat food", k=4))
    ids = [d.id for d in reply.retrieval.documents]
    assert "hr-1" not in ids and ids == sorted(ids) and set(ids) == {"d1", "d2"}
    with pytest.raises(grpc.aio.AioRpcError) as info:  # tenant b has no corpus "kb"
        await generate(channel, rag("cat"), metadata=AUTH_B)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown corpus 'kb'" in info.value.details()


async def test_documents_are_removed_through_the_router_and_the_next_request_sees_it(mesh):
    _, channel = mesh
    stub = router_service_pb2_grpc.RouterServiceStub(channel)
    before = await generate(channel, rag("What does the cat eat?", query="cat"))
    removed = await stub.RemoveDocuments(router_service_pb2.RemoveDocumentsRequest(corpus="kb", ids=["d1"]),
                                         metadata=AUTH_A)
    assert (removed.corpus_version, removed.removed) == (2, 1)
    after = await generate(channel, rag("What does the cat eat?", query="cat"))
    assert [d.id for d in before.retrieval.documents] == ["d1", "d2"]
    assert ([d.id for d in after.retrieval.documents], after.retrieval.cache_hit,
            after.retrieval.corpus_version) == (["d2"], False, 2)
    for call in (stub.RemoveDocuments(router_service_pb2.RemoveDocumentsRequest(corpus="kb", ids=["d2"])),
                 stub.IngestDocuments(router_service_pb2.IngestDocumentsRequest(corpus="kb"))):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call  # no token
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as info:  # tenant b has no corpus "kb" to remove from
        await stub.RemoveDocuments(router_service_pb2.RemoveDocumentsRequest(corpus="kb", ids=["d2"]),
                                   metadata=AUTH_B)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("spec,text", [(dict(k=21), "retrieval.k 21 is out of range [1, 20]"),
                                       (dict(k=-1), "retrieval.k -1"),
                                       (dict(corpus=""), "retrieval.corpus is empty")])
async def test_bad_retrieval_part_is_invalid_argument(mesh, spec, text):
    _, channel = mesh
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(channel, rag("cat", **spec))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert text in info.value.details()


async def test_cache_retrieve_span_is_in_the_request_trace(mesh, spans):
    _, channel = mesh
    await collect(router_service_pb2_grpc.RouterServiceStub(channel), rag("What does the cat eat?"))
    finished = spans.get_finished_spans()
    route = next(s for s in finished if s.name == "route")
    retrieve = next(s for s in finished if s.name == "cache.retrieve")
    assert retrieve.context.trace_id == route.context.trace_id
    assert route.attributes["specmesh.retrieval.documents"] == 2
