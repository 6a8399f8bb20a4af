"""Soak (slow, bounded): 2,000 mixed requests through router -> target -> draft with
cancellations, deadlines, invalid input, stop sequences and a draft restart half-way.

Afterwards nothing is left behind: no KV block is used (cached blocks may stay), neither the
target nor the draft holds a sequence, every request ended OK or with the code expected for
its kind, and resident memory grew by less than RSS_BOUND_MB from the end of the warm-up
(the first 500 requests) to the end.
"""

from __future__ import annotations

import asyncio
import gc
import random

import grpc
import psutil
import pytest

from services.common.server import GrpcServer, ServerConfig
from services.draft.config import DraftConfig
from services.draft.service import SERVICE_NAME, DraftService, add_to_server
from tests.mesh import AUTH_A, AUTH_B, request, start_mesh

NUM_REQUESTS = 2000
WARM_UP = 500
CONCURRENCY = 16
RSS_BOUND_MB = 64
EXPECTED = {  # kind -> codes it may end with
    "complete": {grpc.StatusCode.OK},
    "stop": {grpc.StatusCode.OK},
    "sampled": {grpc.StatusCode.OK},
    "cancel": {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED},
    "deadline": {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED},
    "invalid": {grpc.StatusCode.INVALID_ARGUMENT},
}
KINDS = ["complete"] * 8 + ["stop", "sampled", "sampled"] + ["cancel"] * 3 + ["deadline"] * 2 + ["invalid"] * 2


async def _start_draft(port: int = 0) -> tuple[GrpcServer, DraftService]:
    service = DraftService(DraftConfig(server=ServerConfig(port=port)))
    server = GrpcServer(ServerConfig(port=port), lambda s: add_to_server(s, service), [SERVICE_NAME])
    await server.start()
    return server, service


async def _one(stub, i: int, kind: str) -> grpc.StatusCode:
    rng = random.Random(i)
    prompt = f"request {i}: " + " ".join(rng.choice(["a b c", "1 2 3", "the cat", "x y"]) for _ in range(4))
    sampling = {"stop": ["cat"]} if kind == "stop" else {}
    if kind == "sampled":
        sampling = {"temperature": 0.8, "top_p": 0.9, "seed": i, "has_seed": True}
    if kind == "invalid":
        sampling = {"top_p": 1.5}
    call = stub.Generate(request(prompt, rng.randint(1, 12), **sampling),
                         metadata=AUTH_A if i % 2 else AUTH_B,
                         timeout=0.02 if kind == "deadline" else 120)
    try:
        async for _ in call:
            if kind == "cancel":
                call.cancel()
                return grpc.StatusCode.CANCELLED
    except asyncio.CancelledError:
        return grpc.StatusCode.CANCELLED
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


async def _eventually(check, seconds: float = 30.0) -> bool:
    for _ in range(int(seconds / 0.1)):
        if check():
            return True
        await asyncio.sleep(0.1)
    return check()


@pytest.mark.slow
async def test_soak_2000_mixed_requests_leave_nothing_behind(tiny_llama_dir):
    draft, service = await _start_draft()
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address, draft_timeout_s=1.0,
                            max_num_seqs=CONCURRENCY, num_blocks=512,
                            speculation={"speculation_method": "prompt_lookup", "speculation_depth": 3})
    client = mesh.engine.speculator.client
    gate = asyncio.Semaphore(CONCURRENCY)
    codes: dict[int, grpc.StatusCode] = {}
    rss = {}
    try:
        async def run(i: int) -> None:
            async with gate:
                codes[i] = await _one(mesh.router_stub, i, KINDS[i % len(KINDS)])
        for start in range(0, NUM_REQUESTS, 250):
            await asyncio.gather(*(run(i) for i in range(start, start + 250)))
            if start + 250 == WARM_UP:
                rss["warm"] = _rss_mb()
            if start + 250 == NUM_REQUESTS // 2:  # the draft service restarts on its address
                port = draft.port
                await draft.stop(grace=0)
                draft, service = await _start_draft(port)
        rss["end"] = _rss_mb()
        print(f"soak RSS: {rss['warm']:.0f} MiB after warm-up, {rss['end']:.0f} MiB at the end")
        wrong = {i: c for i, c in codes.items() if c not in EXPECTED[KINDS[i % len(KINDS)]]}
        assert len(codes) == NUM_REQUESTS and not wrong
        assert await _eventually(lambda: mesh.engine.live_request_ids() == set())
        stats = mesh.engine.stats()
        assert stats.used_blocks == 0 and stats.running == 0 and stats.waiting == 0
        assert stats.queued_tokens == 0
        assert await _eventually(lambda: len(service.store) == 0 and client.num_unreleased == 0)
        assert rss["end"] - rss["warm"] < RSS_BOUND_MB, rss
    finally:
        await mesh.stop()
        await draft.stop(grace=0)
