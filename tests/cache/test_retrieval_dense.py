"""Dense and hybrid retrieval (all-MiniLM-L6-v2 from the `dense` extra, offline) over gRPC."""

from __future__ import annotations

import grpc
import pytest

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.cache.embeddings import EmbeddingModelMissing
from services.cache.identity import caller_metadata
from services.cache.retrieval import RRF_K
from specmesh.proto.v1 import cache_service_pb2 as pb
from specmesh.proto.v1 import cache_service_pb2_grpc

A = caller_metadata("tenant-a")
CORPUS = {
    "car": "The automobile needs new tires and an oil change.",
    "fruit": "Bananas and apples are sweet fruit.",
    "code": "The function returns a sorted list of integers.",
    "rain": "Bring an umbrella, showers are expected this afternoon.",
    "hr": "Vehicle repair budgets for the fleet are confidential.",
}


class Modes:
    """One cache server per retrieval mode, each holding CORPUS."""

    async def __aenter__(self) -> Modes:
        self.servers = {m: build_cache_server(CacheConfig(retrieval_mode=m)) for m in ("bm25", "dense", "hybrid")}
        self.channels, self.stubs = [], {}
        for mode, server in self.servers.items():
            await server.start()
            channel = grpc.aio.insecure_channel(server.address)
            self.channels.append(channel)
            self.stubs[mode] = cache_service_pb2_grpc.CacheServiceStub(channel)
            await self.stubs[mode].Ingest(pb.IngestRequest(corpus="kb", documents=[
                pb.Document(id=i, text=t, version=1, labels=["hr"] if i == "hr" else [])
                for i, t in CORPUS.items()]), metadata=A)
        return self

    async def __aexit__(self, *exc) -> None:
        for channel in self.channels:
            await channel.close()
        for server in self.servers.values():
            await server.stop(0)

    async def ranking(self, mode: str, query: str, k: int = 5) -> list[tuple[str, float]]:
        reply = await self.stubs[mode].Retrieve(pb.RetrieveRequest(corpus="kb", query=query, k=k), metadata=A)
        return [(r.document.id, r.score) for r in reply.documents]


async def test_dense_finds_meaning_without_shared_words_and_hybrid_fuses_both_rankings():
    async with Modes() as modes:
        assert await modes.ranking("bm25", "vehicle maintenance") == []  # no word in common
        dense = await modes.ranking("dense", "vehicle maintenance", k=2)
        assert dense[0][0] == "car" and "hr" not in [i for i, _ in dense]  # labels still apply
        assert (await modes.ranking("hybrid", "vehicle maintenance", k=1))[0][0] == "car"
        # Hybrid = reciprocal rank fusion of the BM25 and the dense rankings the service gives.
        query = "sorted fruit"
        bm25, dense = await modes.ranking("bm25", query), await modes.ranking("dense", query)
        assert {i for i, _ in bm25} == {"code", "fruit"}
        fused = {}
        for ranking in (bm25, dense):
            for rank, (doc, _) in enumerate(ranking, start=1):
                fused[doc] = fused.get(doc, 0.0) + 1 / (RRF_K + rank)
        expected = sorted(fused.items(), key=lambda pair: (-pair[1], pair[0]))
        hybrid = await modes.ranking("hybrid", query)
        assert [i for i, _ in hybrid] == [i for i, _ in expected]
        assert [s for _, s in hybrid] == pytest.approx([s for _, s in expected])


def test_missing_embedding_model_is_a_clear_error(tmp_path):
    with pytest.raises(EmbeddingModelMissing, match="no embedding model"):
        build_cache_server(CacheConfig(retrieval_mode="dense", embedding_model=str(tmp_path)))
    with pytest.raises(ValueError, match="retrieval_mode"):
        CacheConfig(retrieval_mode="semantic")
