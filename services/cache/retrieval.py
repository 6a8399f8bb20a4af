"""Tenant-scoped corpora with BM25 retrieval and a versioned result cache.

Documents live in the backend (Redis when shared, memory by default), one hash per
(tenant, corpus), next to the corpus *version*: a counter every ingest or delete
bumps in the same transaction. Each process keeps a BM25 index per corpus (bm25s,
Lucene's scoring) and rebuilds it whenever the stored version differs from the one
it was built from — so after a start, or another instance's ingest, the first query
rebuilds from the stored documents.

Results are cached per (tenant, corpus, corpus version, caller's label set,
normalized query, k); a version bump makes every older entry unreachable. Documents
the caller may not read are dropped before ranking, so nothing cached holds them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import dataclass
from urllib.parse import quote

import bm25s
import numpy as np

from services.cache.config import CacheConfig
from services.cache.identity import Caller
from services.cache.tool_cache import InvalidInput

BM25_K1, BM25_B = 1.5, 0.75
_CORPUS_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_TOKEN = re.compile(r"\w+")
MAX_ID_BYTES = 256
MAX_LABELS = 64


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
        self._indexes: dict[tuple[str, str], _Index] = {}

    async def ingest(self, tenant: str, corpus: str, documents: list[Document]) -> tuple[int, int]:
        """Adds or replaces documents; returns (corpus version, documents in the corpus)."""
        self._check_corpus(corpus)
        self._check_documents(documents)
        index = await self._index(tenant, corpus, must_exist=False)
        total = len(set(index.ids) | {d.id for d in documents})
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
        index = await self._index(caller.tenant, corpus, must_exist=True, known_version=version)
        found = index.search(tokenize(query), caller, k)
        if index.version != version:  # a newer version was read while rebuilding
            result_key = self._result_key(caller, corpus, index.version, query, k)
        if self.config.retrieval_cache:
            await self.backend.set(result_key, _encode_results(found), self.config.retrieval_ttl_seconds * 1000)
        return Retrieved(found, False, index.version)

    # ---- helpers ------------------------------------------------------------------------

    async def _index(self, tenant: str, corpus: str, must_exist: bool,
                     known_version: int | None = None) -> _Index:
        """This process's index of the corpus, rebuilt when the stored version moved on."""
        local = self._indexes.get((tenant, corpus))
        if local is not None and known_version is not None and local.version == known_version:
            return local
        version, fields = await self.backend.hash_read(self._key(tenant, corpus, "docs"),
                                                       self._key(tenant, corpus, "version"))
        if version is None:
            if must_exist:
                raise InvalidInput(f"unknown corpus {corpus!r}")
            return _Index(0, [])
        if local is not None and local.version == version:
            return local
        documents = sorted((_decode(v) for v in fields.values()), key=lambda d: d.id)
        index = await asyncio.to_thread(_Index, version, documents)
        self._indexes[(tenant, corpus)] = index
        return index

    def _key(self, tenant: str, corpus: str, part: str) -> str:
        return ":".join((self.config.namespace, "t", quote(tenant, safe=""), "corpus", corpus, part))

    def _result_key(self, caller: Caller, corpus: str, version: int, query: str, k: int) -> str:
        normal = " ".join(tokenize(query))
        digest = hashlib.sha256(f"{caller.label_key}\0{normal}\0{k}".encode()).hexdigest()
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
    """BM25 over one corpus version (built off the event loop: it is CPU work)."""

    def __init__(self, version: int, documents: list[Document]) -> None:
        self.version = version
        self.documents = documents
        self.ids = [d.id for d in documents]
        self._bm25 = None
        if documents:
            self._bm25 = bm25s.BM25(k1=BM25_K1, b=BM25_B, method="lucene")
            self._bm25.index([tokenize(d.text) for d in documents], show_progress=False)

    def search(self, query_tokens: list[str], caller: Caller, k: int) -> list[tuple[Document, float]]:
        if self._bm25 is None:
            return []
        known = [t for t in query_tokens if t in self._bm25.vocab_dict]
        if not known:
            return []
        scores = np.asarray(self._bm25.get_scores(known), dtype=np.float64)
        ranked = sorted(((float(scores[i]), d) for i, d in enumerate(self.documents)
                         if scores[i] > 0 and caller.may_read(d.labels)),
                        key=lambda pair: (-pair[0], pair[1].id))
        return [(d, s) for s, d in ranked[:k]]


def _encode(d: Document) -> bytes:
    return json.dumps({"id": d.id, "text": d.text, "version": d.version, "labels": list(d.labels)}).encode()


def _decode(raw: bytes) -> Document:
    o = json.loads(raw)
    return Document(o["id"], o["text"], int(o["version"]), tuple(o["labels"]))


def _encode_results(found: list[tuple[Document, float]]) -> bytes:
    return json.dumps([[json.loads(_encode(d)), s] for d, s in found]).encode()


def _decode_results(raw: bytes) -> list[tuple[Document, float]]:
    return [(_decode(json.dumps(d).encode()), float(s)) for d, s in json.loads(raw)]
