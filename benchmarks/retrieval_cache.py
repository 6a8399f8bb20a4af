"""Retrieval-augmented requests on the default model: the retrieval cache and canonical
document order vs no retrieval cache and documents in retrieval-score order. One run, side
by side, requests alternating between the two setups (each its own target and cache service).

    python benchmarks/retrieval_cache.py [--documents 50 --requests 30 --k 3]

Each request: Retrieve from the cache service over gRPC (BM25, top-k), build the prompt
with the router's template (services/router/retrieval.py), Generate one token on the
target over gRPC. TTFT = retrieval + prefill until the first token, measured at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import grpc

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.cache.identity import caller_metadata
from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from specmesh.proto.v1 import cache_service_pb2 as cpb
from specmesh.proto.v1 import (
    cache_service_pb2_grpc,
    common_pb2,
    target_service_pb2,
    target_service_pb2_grpc,
)
from services.common.server import ServerConfig
from services.router.retrieval import DOCUMENT, HEADER, QUESTION, build_prompt
from services.target.server.app import build_target_server
from services.target.config import EngineConfig
from services.target.engine.engine import Engine

TOPICS = ["river", "mountain", "harbor", "forest", "desert", "glacier", "island", "canyon",
          "valley", "volcano"]
WHO = caller_metadata("bench")


def corpus(n: int, rng: random.Random) -> list[cpb.Document]:
    """n documents, each about two topics, ~100 tokens."""
    docs = []
    for i in range(n):
        a, b = rng.sample(TOPICS, 2)
        facts = " ".join(f"The {a} near site {i} has marker {rng.randint(100, 999)} and the {b} "
                         f"path {j} takes {rng.randint(2, 90)} minutes." for j in range(3))
        docs.append(cpb.Document(id=f"doc-{i:03d}", text=facts, version=1))
    return docs


def workload(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """(query, question) pairs: 12 distinct topic queries, each asked with new questions."""
    queries = [f"{a} {b}" for a, b in (rng.sample(TOPICS, 2) for _ in range(12))]
    return [(q, f"Request {i}: how long does the {q.split()[0]} path take?")
            for i, q in enumerate(rng.choice(queries) for _ in range(n))]


def score_order_prompt(reply: cpb.RetrieveResponse, question: str) -> str:
    """The same template, documents in retrieval-score order (the baseline)."""
    return HEADER + "".join(DOCUMENT.format(id=r.document.id, version=r.document.version,
                                            text=r.document.text) for r in reply.documents) \
        + QUESTION.format(question=question)


class Setup:
    def __init__(self, name: str, engine: Engine, retrieval_cache: bool, canonical: bool) -> None:
        self.name, self.engine, self.canonical = name, engine, canonical
        self.target = build_target_server(ServerConfig(port=0), engine, "default")
        self.cache = build_cache_server(CacheConfig(retrieval_cache=retrieval_cache,
                                                    replicas=()))
        self.ttft, self.cached_tokens, self.prompt_tokens, self.hits = [], 0, 0, 0

    async def start(self, documents) -> None:
        await self.target.start()
        await self.cache.start()
        self.channels = [grpc.aio.insecure_channel(s.address) for s in (self.cache, self.target)]
        self.cache_stub = cache_service_pb2_grpc.CacheServiceStub(self.channels[0])
        self.target_stub = target_service_pb2_grpc.TargetServiceStub(self.channels[1])
        await self.cache_stub.Ingest(cpb.IngestRequest(corpus="kb", documents=documents), metadata=WHO)

    async def run(self, query: str, question: str, k: int) -> None:
        start = time.perf_counter()
        reply = await self.cache_stub.Retrieve(cpb.RetrieveRequest(corpus="kb", query=query, k=k),
                                               metadata=WHO)
        if self.canonical:
            prompt = build_prompt([(r.document.id, r.document.version, r.document.text)
                                   for r in reply.documents], question)
        else:
            prompt = score_order_prompt(reply, question)
        request = target_service_pb2.TargetServiceGenerateRequest(
            prompt=prompt, tenant_salt="bench", sampling=common_pb2.SamplingParams(max_tokens=1))
        first = None
        async for response in self.target_stub.Generate(request):
            if first is None and response.chunk.token_ids:
                first = time.perf_counter()
            if response.chunk.HasField("usage"):
                self.cached_tokens += response.chunk.usage.cached_prompt_tokens
                self.prompt_tokens += response.chunk.usage.prompt_tokens
        self.ttft.append(first - start)
        self.hits += reply.cache_hit

    async def stop(self) -> None:
        for channel in self.channels:
            await channel.close()
        await self.cache.stop(0)
        await self.target.stop(0)


async def main_async(args) -> None:
    rng = random.Random(args.seed)
    documents, requests = corpus(args.documents, rng), workload(args.requests, rng)
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    config = EngineConfig(model_dir=model_dir, dtype="bfloat16", num_blocks=2048, max_batched_tokens=512)
    setups = [Setup("retrieval cache + canonical order", Engine.load(config), True, True),
              Setup("no retrieval cache + score order", Engine.load(config), False, False)]
    for s in setups:
        await s.start(documents)
    for i, (query, question) in enumerate(requests):
        for s in (setups if i % 2 == 0 else setups[::-1]):  # alternate: drift hits both
            await s.run(query, question, args.k)
    for s in setups:
        await s.stop()
    print(f"\nmodel={args.model} bf16, {args.documents} documents, {args.requests} requests "
          f"(12 distinct queries), k={args.k}, block_size={config.block_size}")
    print(f"{'setup':36} {'TTFT p50':>9} {'TTFT mean':>10} {'saved prefill':>14} {'prefix hit':>11} "
          f"{'retrieval hits':>15}")
    for s in setups:
        print(f"{s.name:36} {statistics.median(s.ttft) * 1000:7.1f}ms {statistics.mean(s.ttft) * 1000:8.1f}ms "
              f"{s.cached_tokens:8d} tok {100 * s.cached_tokens / s.prompt_tokens:10.1f}% "
              f"{s.hits:8d}/{len(s.ttft)}")
    a, b = setups
    print(f"TTFT p50 ratio (baseline / cached+canonical): "
          f"{statistics.median(b.ttft) / statistics.median(a.ttft):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--documents", type=int, default=50)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
