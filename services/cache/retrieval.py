"""Tenant-scoped corpora with BM25 (or dense / hybrid) retrieval and a versioned result cache.

Documents live in the backend (Redis when shared, memory by default), one hash per
(tenant, corpus), next to the corpus *version*: a counter every ingest or delete
bumps in the same transaction. Each process keeps a BM25 index per corpus (bm25s,
Lucene's scoring) and rebuilds it whenever the stored version differs from the one
it was built from — so after a start, or another instance's ingest, the first query
rebuilds from the stored documents.

Scoring (`CacheConfig.retrieval_mode`): `bm25`; `dense`, the cosine of sentence
embeddings (services/cache/embeddings.py); or `hybrid`, reciprocal rank fusion of the two
rankings (score = sum over rankings of 1 / (RRF_K + rank)).

Results are cached per (tenant, corpus, corpus version, caller's label set,
normalized query, k, mode); a version bump makes every older entry unreachable. Documents
the caller may not read are dropped before ranking, so nothing cached holds them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import quote

import bm25s
import numpy as np

from services.cache.config import CacheConfig
from services.cache.identity import Caller
from services.cache.tool_cache import InvalidInput

BM25_K1, BM25_B = 1.5, 0.75
RRF_K = 60  # reciprocal rank fusion constant (Cormack et al. 2009)
_CORPUS_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_TOKEN = re.compile(r"\w+")
MAX_ID_BYTES = 256
MAX_LABELS = 64
MAX_INDEXES = 256  # corpora whose index one process keeps in memory


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    version: int
    labels: tuple[str, ...]  # sorted, distinct


@dataclass(frozen=True)
class Retrieved:
    documents: list[tuple[Document, float]]  # best first: score descending, then id
    cache_hit: bool
    corpus_version: int


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens; the query's normal form is these joined by spaces."""
    return _TOKEN.findall(text.lower())


class Corpora:
    def __init__(self, config: CacheConfig, backend) -> None:
        self.config = config
        self.backend = backend
        # (tenant, corpus) -> index, least recently used first; at most MAX_INDEXES are kept
        # (an evicted corpus is rebuilt from the backend on its next query).
        self._indexes: OrderedDict[tuple[str, str], _Index] = OrderedDict()
        self.embedder = None
        if config.retrieval_mode != "bm25":
            from services.cache.embeddings import Embedder
            self.embedder = Embedder(config.embedding_model or None)

    async def ingest(self, tenant: str, corpus: str, documents: list[Document]) -> tuple[int, int]:
        """Adds or replaces documents; returns (corpus version, documents in the corpus)."""
        self._check_corpus(corpus)
        self._check_documents(documents)
        held, replaced = await self.backend.hash_count(self._key(tenant, corpus, "docs"),
                                                       [d.id for d in documents])
        total = held + len(documents) - replaced
        if total > self.config.max_documents_per_corpus:
            raise InvalidInput(f"corpus would hold {total} documents, above the limit of "
                               f"{self.config.max_documents_per_corpus}")
        version, _ = await self.backend.hash_update(
            self._key(tenant, corpus, "docs"), {d.id: _encode(d) for d in documents}, [],
            self._key(tenant, corpus, "version"))
        return version, total

    async def delete(self, tenant: str, corpus: str, ids: list[str]) -> tuple[int, int]:
        """Deletes documents by id; returns (corpus version, documents deleted)."""
        self._check_corpus(corpus)
        if not ids or not all(ids):
            raise InvalidInput("ids must be a non-empty list of non-empty ids")
        if await self.backend.get_int(self._key(tenant, corpus, "version")) is None:
            raise InvalidInput(f"unknown corpus {corpus!r}")
        return await self.backend.hash_update(self._key(tenant, corpus, "docs"), {}, list(ids),
                                              self._key(tenant, corpus, "version"))

    async def retrieve(self, caller: Caller, corpus: str, query: str, k: int) -> Retrieved:
        self._check_corpus(corpus)
        problems = []
        if not tokenize(query):
            problems.append("query has no words")
        if len(query.encode()) > self.config.max_query_bytes:
            problems.append(f"query is above the limit of {self.config.max_query_bytes} bytes")
        if not 1 <= k <= self.config.max_k:
            problems.append(f"k {k} is out of range [1, {self.config.max_k}]")
        if problems:
            raise InvalidInput("; ".join(problems))
        version = await self.backend.get_int(self._key(caller.tenant, corpus, "version"))
        if version is None:
            raise InvalidInput(f"unknown corpus {corpus!r}")
        result_key = self._result_key(caller, corpus, version, query, k)
        cached = await self.backend.get(result_key) if self.config.retrieval_cache else None
        if cached is not None:
            return Retrieved(_decode_results(cached), True, version)
        index = await self._index(caller.tenant, corpus, known_version=version)
        query_vector = None
        if self.embedder is not None and index.documents:
            query_vector = (await asyncio.to_thread(self.embedder.embed, [" ".join(tokenize(query))]))[0]
        found = index.search(tokenize(query), query_vector, caller, k, self.config.retrieval_mode)
        if index.version != version:  # a newer version was read while rebuilding
            result_key = self._result_key(caller, corpus, index.version, query, k)
        if self.config.retrieval_cache:
            await self.backend.set(result_key, _encode_results(found), self.config.retrieval_ttl_seconds * 1000)
        return Retrieved(found, False, index.version)

    # ---- helpers ------------------------------------------------------------------------

    async def _index(self, tenant: str, corpus: str, known_version: int) -> _Index:
        """This process's index of the corpus, rebuilt when the stored version moved on."""
        local = self._indexes.get((tenant, corpus))
        if local is not None:
            self._indexes.move_to_end((tenant, corpus))
            if local.version == known_version:
                return local
        version, fields = await self.backend.hash_read(self._key(tenant, corpus, "docs"),
                                                       self._key(tenant, corpus, "version"))
        if version is None:
            raise InvalidInput(f"unknown corpus {corpus!r}")
        if local is not None and local.version == version:
            return local
        documents = sorted((_decode(v) for v in fields.values()), key=lambda d: d.id)
        vectors = local.vectors if local is not None else {}
        index = await asyncio.to_thread(_Index, version, documents, self.embedder, vectors)
        self._indexes[(tenant, corpus)] = index
        while len(self._indexes) > MAX_INDEXES:
            self._indexes.popitem(last=False)
        return index

    def _key(self, tenant: str, corpus: str, part: str) -> str:
        return ":".join((self.config.namespace, "t", quote(tenant, safe=""), "corpus", corpus, part))

    def _result_key(self, caller: Caller, corpus: str, version: int, query: str, k: int) -> str:
        normal = " ".join(tokenize(query))
        mode = self.config.retrieval_mode
        digest = hashlib.sha256(f"{caller.label_key}\0{normal}\0{k}\0{mode}".encode()).hexdigest()
        return ":".join((self.config.namespace, "t", quote(caller.tenant, safe=""), "retrieval",
                         corpus, str(version), digest))

    def _check_corpus(self, corpus: str) -> None:
        if not _CORPUS_NAME.match(corpus):
            raise InvalidInput(f"corpus name must be 1-128 characters of A-Z a-z 0-9 . _ -, got {corpus[:64]!r}")

    def _check_documents(self, documents: list[Document]) -> None:
        problems = []
        if not documents:
            problems.append("no documents")
        ids = [d.id for d in documents]
        if len(set(ids)) != len(ids):
            problems.append("duplicate document ids")
        for i, d in enumerate(documents):
            if not d.id or len(d.id.encode()) > MAX_ID_BYTES:
                problems.append(f"documents[{i}].id must be 1-{MAX_ID_BYTES} bytes")
            if not d.text.strip():
                problems.append(f"documents[{i}].text is empty")
            elif len(d.text.encode()) > self.config.max_document_bytes:
                problems.append(f"documents[{i}].text is above the limit of "
                                f"{self.config.max_document_bytes} bytes")
            if len(d.labels) > MAX_LABELS or not all(d.labels) or any("," in x for x in d.labels):
                problems.append(f"documents[{i}].labels: at most {MAX_LABELS} non-empty labels without ','")
        if problems:
            raise InvalidInput("; ".join(problems[:10]))


class _Index:
    """One corpus version: BM25, plus document embeddings when an embedder is given.

    Built off the event loop (it is CPU work). `vectors` (text digest -> embedding) of the
    previous version are reused, so an ingest embeds only new or changed texts."""

    def __init__(self, version: int, documents: list[Document], embedder=None,
                 vectors: dict[str, np.ndarray] | None = None) -> None:
        self.version = version
        self.documents = documents
        self._bm25 = None
        self.vectors: dict[str, np.ndarray] = {}
        self._matrix = None  # [num_documents, dim] unit rows
        if documents:
            self._bm25 = bm25s.BM25(k1=BM25_K1, b=BM25_B, method="lucene")
            self._bm25.index([tokenize(d.text) for d in documents], show_progress=False)
        if documents and embedder is not None:
            old = vectors or {}
            keys = [_digest(d.text) for d in documents]
            missing = [i for i, key in enumerate(keys) if key not in old]
            fresh = embedder.embed([documents[i].text for i in missing]) if missing else []
            self.vectors = {key: old[key] for key in keys if key in old}
            self.vectors.update({keys[i]: fresh[j] for j, i in enumerate(missing)})
            self._matrix = np.stack([self.vectors[key] for key in keys])

    def search(self, query_tokens: list[str], query_vector: np.ndarray | None, caller: Caller, k: int,
               mode: str = "bm25") -> list[tuple[Document, float]]:
        """Top-k readable documents, best first (score descending, then id)."""
        readable = [i for i, d in enumerate(self.documents) if caller.may_read(d.labels)]
        if mode == "bm25":
            return self._top(self._bm25_ranking(query_tokens, readable), k)
        dense = self._dense_ranking(query_vector, readable)
        if mode == "dense":
            return self._top(dense, k)
        fused: dict[int, float] = {}
        for ranking in (self._bm25_ranking(query_tokens, readable), dense):
            for rank, (i, _) in enumerate(ranking, start=1):
                fused[i] = fused.get(i, 0.0) + 1.0 / (RRF_K + rank)
        return self._top(self._sorted(fused.items()), k)

    def _bm25_ranking(self, query_tokens: list[str], readable: list[int]) -> list[tuple[int, float]]:
        known = [t for t in query_tokens if self._bm25 is not None and t in self._bm25.vocab_dict]
        if not known:
            return []
        scores = np.asarray(self._bm25.get_scores(known), dtype=np.float64)
        return self._sorted((i, float(scores[i])) for i in readable if scores[i] > 0)

    def _dense_ranking(self, query_vector: np.ndarray | None, readable: list[int]) -> list[tuple[int, float]]:
        if self._matrix is None or query_vector is None:
            return []
        cosine = self._matrix @ query_vector  # [num_documents]
        return self._sorted((i, float(cosine[i])) for i in readable if cosine[i] > 0)

    def _sorted(self, scored) -> list[tuple[int, float]]:
        return sorted(scored, key=lambda pair: (-pair[1], self.documents[pair[0]].id))

    def _top(self, ranking: list[tuple[int, float]], k: int) -> list[tuple[Document, float]]:
        return [(self.documents[i], s) for i, s in ranking[:k]]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _encode(d: Document) -> bytes:
    return json.dumps({"id": d.id, "text": d.text, "version": d.version, "labels": list(d.labels)}).encode()


def _decode(raw: bytes) -> Document:
    o = json.loads(raw)
    return Document(o["id"], o["text"], int(o["version"]), tuple(o["labels"]))


def _encode_results(found: list[tuple[Document, float]]) -> bytes:
    return json.dumps([[json.loads(_encode(d)), s] for d, s in found]).encode()


def _decode_results(raw: bytes) -> list[tuple[Document, float]]:
    return [(_decode(json.dumps(d).encode()), float(s)) for d, s in json.loads(raw)]
