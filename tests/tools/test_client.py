"""specmesh.client: imports without torch; retries UNAVAILABLE / RESOURCE_EXHAUSTED before the
first token after the server's pushback hint; never retries after tokens were streamed."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from specmesh.client import AsyncClient, Client, RetryPolicy
from tests.mesh import TOKEN_A, collect, request, start_mesh
from tests.scripted_router import serve


def test_import_does_not_load_torch_or_transformers():
    code = ("import sys, specmesh.client; "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_async_resource_exhausted_is_retried_after_the_pushback_hint():
    server, service, address = await serve([(grpc.StatusCode.RESOURCE_EXHAUSTED, "300"), ["a", "b"]])
    delays = []
    try:
        async with AsyncClient(address, token="t", sleep=delays.append) as client:
            answer = await client.complete("hi", max_tokens=2)
    finally:
        await server.stop(None)
    assert (answer.text, answer.token_ids, answer.finish_reason) == ("ab", (0, 1), "length")
    assert delays == [0.3]
    assert service.calls[1] - service.calls[0] >= 0.3  # lower bound: it waited at least the hint
    assert service.tokens == ["Bearer t", "Bearer t"]


async def test_sync_unavailable_is_retried_after_the_pushback_hint():
    server, service, address = await serve([(grpc.StatusCode.UNAVAILABLE, "200"),
                                            (grpc.StatusCode.UNAVAILABLE, "100"), ["x"]])
    delays = []

    def run():
        with Client(address, sleep=delays.append) as client:
            return list(client.chat([{"role": "user", "content": "hi"}]))
    try:
        chunks = await asyncio.to_thread(run)
    finally:
        await server.stop(None)
    assert [c.text for c in chunks] == ["x"]
    assert delays == [0.2, 0.1]


@pytest.mark.parametrize("script, calls", [
    ([{"texts": ["a"], "then": grpc.StatusCode.UNAVAILABLE}], 1),  # tokens already streamed
    ([(grpc.StatusCode.RESOURCE_EXHAUSTED, "-1")], 1),  # negative pushback: do not retry
    ([(grpc.StatusCode.INVALID_ARGUMENT, None)], 1),  # not retryable
    ([(grpc.StatusCode.UNAVAILABLE, "5000")], 1),  # the hint is past the call's deadline
    ([(grpc.StatusCode.UNAVAILABLE, "0")] * 3, 3),  # max_attempts
])
async def test_what_is_not_retried(script, calls):
    server, service, address = await serve(script)
    delays = []
    try:
        async with AsyncClient(address, sleep=delays.append, timeout=2.0,
                               retry=RetryPolicy(max_attempts=3)) as client:
            with pytest.raises(grpc.aio.AioRpcError):
                [chunk async for chunk in client.generate("hi")]
    finally:
        await server.stop(None)
    assert len(service.calls) == calls
    assert delays == [0.0] * (calls - 1)


async def test_against_a_tiny_mesh(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        ids, text, _ = await collect(mesh.router_stub, request("The quick brown fox", max_tokens=8))
        async with AsyncClient(mesh.router.address, token=TOKEN_A) as client:
            answer = await client.complete("The quick brown fox", max_tokens=8)
            models = await client.list_models()
        assert (answer.text, list(answer.token_ids)) == (text, ids)
        assert answer.usage.completion_tokens == 8
        assert [p.name for p in models.pools] == ["default"]

        def sync_run():
            with Client(mesh.router.address, token=TOKEN_A) as client:
                return client.complete("The quick brown fox", max_tokens=8)
        assert (await asyncio.to_thread(sync_run)).text == text
    finally:
        await mesh.stop()


async def test_stream_yields_the_routers_responses_with_the_callers_metadata():
    server, service, address = await serve([(grpc.StatusCode.UNAVAILABLE, "0"), ["a", "b"]])
    try:
        async with AsyncClient(address, token="own", sleep=lambda _: None) as client:
            responses = [r async for r in client.stream(request("hi", max_tokens=2),
                                                        metadata=(("authorization", "Bearer caller"),))]
    finally:
        await server.stop(None)
    assert [r.chunk.text for r in responses] == ["a", "b"]  # GenerateResponse, route field and all
    assert service.tokens == ["Bearer caller"] * 2  # retried, with the caller's credential each time
