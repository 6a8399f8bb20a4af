"""Retrieval in the cache service: BM25 ranking, tenants, access labels, versioned result cache."""

from __future__ import annotations

import math
import uuid

import grpc
import pytest
import redis.asyncio as aioredis

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.cache.identity import caller_metadata
from specmesh.proto.v1 import cache_service_pb2 as pb
from specmesh.proto.v1 import cache_service_pb2_grpc

REDIS_URL = "redis://127.0.0.1:6379/0"
A, B = caller_metadata("tenant-a"), caller_metadata("tenant-b")
A_HR = caller_metadata("tenant-a", ["hr", "staff"])
A_STAFF = caller_metadata("tenant-a", ["staff"])
CORPUS = {
    "d1": "the cat sat on the mat",
    "d2": "the dog sat on the log by the dog house",
    "d3": "cats and dogs",
    "d4": "the cat chased the dog",
    "d5": "a bird",
}


class Instance:
    def __init__(self, **config) -> None:
        self.server = build_cache_server(CacheConfig(**config))

    async def __aenter__(self) -> Instance:
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = cache_service_pb2_grpc.CacheServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(0)

    async def ingest(self, docs: dict[str, str], corpus="docs", metadata=A, labels=(), version=1):
        return await self.stub.Ingest(pb.IngestRequest(corpus=corpus, documents=[
            pb.Document(id=i, text=t, version=version, labels=list(labels)) for i, t in docs.items()]),
            metadata=metadata)

    async def retrieve(self, query: str, k: int = 3, corpus="docs", metadata=A) -> pb.RetrieveResponse:
        return await self.stub.Retrieve(pb.RetrieveRequest(corpus=corpus, query=query, k=k),
                                        metadata=metadata)


def ranked(reply: pb.RetrieveResponse) -> list[str]:
    return [r.document.id for r in reply.documents]


@pytest.fixture
async def namespace():
    name = f"specmesh-test-{uuid.uuid4().hex}"
    yield name
    client = aioredis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{name}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def cache(request, namespace):
    config = {} if request.param == "memory" else dict(backend="redis", redis_url=REDIS_URL,
                                                       namespace=namespace)
    async with Instance(**config) as instance:
        yield instance


def lucene_bm25(query: list[str], corpus: dict[str, str], k1=1.5, b=0.75) -> dict[str, float]:
    """BM25 as Lucene scores it (bm25s method="lucene"), written out by hand:
    idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)),
    score(d) = sum_t idf(t) * tf / (tf + k1 * (1 - b + b * |d| / avgdl))."""
    docs = {i: t.split() for i, t in corpus.items()}
    avgdl = sum(map(len, docs.values())) / len(docs)
    scores = {}
    for i, words in docs.items():
        score = 0.0
        for term in query:
            df = sum(term in w for w in docs.values())
            tf = words.count(term)
            idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
            score += idf * tf / (tf + k1 * (1 - b + b * len(words) / avgdl))
        scores[i] = score
    return scores


async def test_bm25_ranking_equals_hand_computed_scores(cache):
    await cache.ingest(CORPUS)
    reply = await cache.retrieve("Cat, dog?", k=5)
    expected = lucene_bm25(["cat", "dog"], CORPUS)
    # By hand: N=5, avgdl=26/5, idf(cat)=idf(dog)=ln(2.4); d2 has dog twice, d4 both terms.
    assert ranked(reply) == ["d4", "d2", "d1"]  # d3 ("cats", "dogs") and d5 score 0: left out
    assert [r.score for r in reply.documents] == pytest.approx([expected[i] for i in ranked(reply)],
                                                               rel=1e-5)
    assert reply.documents[0].score == pytest.approx(2 * math.log(2.4) / (1 + 1.5 * (0.25 + 0.75 * 5 / 5.2)),
                                                     rel=1e-5)
    assert (await cache.retrieve("cat dog", k=2)).documents[1].document.id == "d2"


async def test_result_cache_and_every_change_is_seen_by_the_next_identical_query(cache):
    first = await cache.ingest(CORPUS)
    assert (first.corpus_version, first.num_documents) == (1, 5)
    miss, hit = await cache.retrieve("cat"), await cache.retrieve("  CAT ")  # same normalized query
    assert (miss.cache_hit, hit.cache_hit, ranked(hit)) == (False, True, ranked(miss))
    assert ranked(miss) == ["d4", "d1"]
    await cache.ingest({"d6": "cat cat cat"}, version=2)
    after_ingest = await cache.retrieve("cat")
    assert (after_ingest.cache_hit, after_ingest.corpus_version, ranked(after_ingest)) == (False, 2, ["d6", "d4", "d1"])
    deleted = await cache.stub.DeleteDocuments(pb.DeleteDocumentsRequest(corpus="docs", ids=["d6", "nope"]),
                                               metadata=A)
    assert (deleted.corpus_version, deleted.deleted) == (3, 1)
    after_delete = await cache.retrieve("cat")
    assert (after_delete.cache_hit, ranked(after_delete)) == (False, ["d4", "d1"])
    assert (await cache.retrieve("cat", k=1)).cache_hit is False  # k is part of the key


async def test_tenants_never_see_each_others_corpora(cache):
    await cache.ingest(CORPUS)
    await expect_invalid(cache.retrieve("cat", metadata=B), "unknown corpus 'docs'")
    await cache.ingest({"b1": "the cat of tenant b"}, metadata=B)
    assert ranked(await cache.retrieve("cat", metadata=B)) == ["b1"]
    assert ranked(await cache.retrieve("cat", metadata=A)) == ["d4", "d1"]


async def test_documents_need_every_label_cached_or_not(cache, namespace):
    await cache.ingest(CORPUS)
    await cache.ingest({"secret": "cat salaries and the cat bonus plan"}, labels=["hr"])
    for _ in range(2):  # a miss, then a hit: neither holds the labelled document
        assert ranked(await cache.retrieve("cat", metadata=A)) == ["d4", "d1"]
        assert ranked(await cache.retrieve("cat", metadata=A_STAFF)) == ["d4", "d1"]
    hr = await cache.retrieve("cat", metadata=A_HR)
    assert (hr.cache_hit, ranked(hr)) == (False, ["secret", "d4", "d1"])
    assert list(hr.documents[0].document.labels) == ["hr"]
    if cache.server.service.config.backend == "redis":  # cached results of other label sets hold no trace of it
        client = aioredis.from_url(REDIS_URL)
        try:
            keys = [k async for k in client.scan_iter(match=f"{namespace}:t:tenant-a:retrieval:*")]
            values = [await client.get(k) for k in keys]
        finally:
            await client.aclose()
        assert len(values) == 3 and sum(b"salaries" in v for v in values) == 1


async def test_index_is_rebuilt_from_redis_on_another_instance_and_after_restart(namespace):
    shared = dict(backend="redis", redis_url=REDIS_URL, namespace=namespace)
    async with Instance(**shared) as first:
        await first.ingest(CORPUS)
        async with Instance(**shared) as second:
            assert ranked(await second.retrieve("dog")) == ["d2", "d4"]
            await second.ingest({"d7": "dog dog dog"})
            # The first instance's index was built at version 1; it sees version 2 and rebuilds.
            assert ranked(await first.retrieve("dog")) == ["d7", "d2", "d4"]
    async with Instance(**shared) as restarted:
        reply = await restarted.retrieve("dog")
        assert (reply.cache_hit, ranked(reply)) == (True, ["d7", "d2", "d4"])
        assert ranked(await restarted.retrieve("dog log")) == ["d2", "d7", "d4"]


BAD = {
    "unknown corpus": (dict(corpus="missing"), "unknown corpus 'missing'"),
    "bad corpus name": (dict(corpus="a:b"), "corpus name"),
    "k zero": (dict(k=0), "k 0 is out of range [1, 50]"),
    "k too big": (dict(k=51), "k 51 is out of range"),
    "empty query": (dict(query="  ?! "), "query has no words"),
    "oversized query": (dict(query="cat " * 3000), "query is above"),
}


@pytest.mark.parametrize("name", list(BAD))
async def test_bad_retrieve_is_invalid_argument_and_stores_nothing(cache, name):
    fields, text = BAD[name]
    await cache.ingest(CORPUS)
    request = dict(corpus="docs", query="cat", k=3) | fields
    await expect_invalid(cache.stub.Retrieve(pb.RetrieveRequest(**request), metadata=A), text)
    assert (await cache.retrieve("cat")).cache_hit is False  # nothing was cached for it


BAD_INGESTS = {
    "no documents": ([], "no documents"),
    "empty id": ([pb.Document(id="", text="x")], "id must be"),
    "duplicate ids": ([pb.Document(id="x", text="a"), pb.Document(id="x", text="b")], "duplicate"),
    "empty text": ([pb.Document(id="x", text=" ")], "text is empty"),
    "oversized text": ([pb.Document(id="x", text="a" * 300_000)], "text is above"),
    "bad label": ([pb.Document(id="x", text="a", labels=["a,b"])], "labels"),
}


@pytest.mark.parametrize("name", list(BAD_INGESTS))
async def test_bad_ingest_is_invalid_argument_and_stores_nothing(cache, name):
    documents, text = BAD_INGESTS[name]
    await expect_invalid(cache.stub.Ingest(pb.IngestRequest(corpus="docs", documents=documents),
                                           metadata=A), text)
    await expect_invalid(cache.retrieve("a"), "unknown corpus")  # the corpus was not created
    await expect_invalid(cache.stub.DeleteDocuments(pb.DeleteDocumentsRequest(corpus="docs", ids=["x"]),
                                                    metadata=A), "unknown corpus")


async def test_corpus_size_limit_counts_replacements_once():
    async with Instance(max_documents_per_corpus=3) as cache:
        assert (await cache.ingest({"a": "x", "b": "y"})).num_documents == 2
        assert (await cache.ingest({"b": "y2", "c": "z"})).num_documents == 3  # b replaced
        await expect_invalid(cache.ingest({"d": "w"}), "corpus would hold 4 documents, above the limit of 3")
        assert [r.document.text for r in (await cache.retrieve("y2")).documents] == ["y2"]


async def test_only_the_most_recent_indexes_stay_in_memory(monkeypatch):
    import services.cache.retrieval as retrieval
    monkeypatch.setattr(retrieval, "MAX_INDEXES", 1)
    async with Instance(retrieval_cache=False) as cache:
        await cache.ingest({"a1": "apple pie"}, corpus="one")
        await cache.ingest({"b1": "banana bread"}, corpus="two")
        for corpus, query, expected in (("one", "apple", "a1"), ("two", "banana", "b1"), ("one", "pie", "a1")):
            assert ranked(await cache.retrieve(query, corpus=corpus)) == [expected]
        assert list(cache.server.service.corpora._indexes) == [("tenant-a", "one")]


async def test_retrieve_span_and_identity_required(cache, spans):
    await cache.ingest(CORPUS)
    await cache.retrieve("secret cat")
    await cache.retrieve("secret cat")
    found = [s for s in spans.get_finished_spans() if s.name == "cache.retrieve"]
    assert [(s.attributes["specmesh.cache_hit"], s.attributes["specmesh.retrieved_documents"])
            for s in found] == [(False, 2), (True, 2)]
    assert not any("secret" in str(v) for s in found for v in s.attributes.values())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cache.retrieve("cat", metadata=())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def expect_invalid(call, text: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert text in info.value.details(), info.value.details()
