"""Caller-controlled sizes are bounded before any work, tokenizing does not
block the target's event loop, and stop matching does not scan every stop sequence."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import details_of
from services.common.limits import DEFAULT_MAX_PROMPT_BYTES, RequestLimits
from specmesh.proto.v1 import common_pb2, target_service_pb2
from services.target.output.stop_matcher import StopMatcher
from tests.mesh import AUTH_B, collect, request, start_mesh


@pytest.fixture
async def mesh(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, limits=RequestLimits(max_prompt_bytes=4000))
    calls = []
    tokenize = mesh.engine.tokenize
    mesh.engine.tokenize = lambda prompt: calls.append(len(prompt)) or tokenize(prompt)
    mesh.tokenize_calls = calls
    yield mesh
    await mesh.stop()


async def _error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value


def _fields(error) -> list[str]:
    return [v.field for v in details_of(error)["BadRequest"].field_violations]


async def test_router_refuses_a_prompt_over_its_byte_limit_before_any_work(mesh):
    error = await _error(mesh.router_stub.Generate(request("x" * (DEFAULT_MAX_PROMPT_BYTES + 1), 4),
                                                   metadata=AUTH_B))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(error)["ErrorInfo"].reason == "REQUEST_TOO_LARGE"
    assert _fields(error) == ["prompt"]
    # Multi-byte characters count as bytes: 350,000 x 3 bytes > 1 MiB.
    error = await _error(mesh.router_stub.Generate(request("€" * 350_000, 4), metadata=AUTH_B))
    assert _fields(error) == ["prompt"]
    assert mesh.tokenize_calls == []


async def test_router_refuses_too_many_or_too_long_stop_sequences(mesh):
    error = await _error(mesh.router_stub.Generate(
        request("hello", 4, stop=[f"s{i}" for i in range(17)]), metadata=AUTH_B))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _fields(error) == ["sampling.stop"]
    error = await _error(mesh.router_stub.Generate(
        request("hello", 4, stop=["ok", "y" * 257]), metadata=AUTH_B))
    assert _fields(error) == ["sampling.stop[1]"]
    _, _, last = await collect(mesh.router_stub, request("hello", 4, stop=[f"s{i}" for i in range(16)]),
                               metadata=AUTH_B)
    assert last.usage.completion_tokens > 0  # the limits themselves are allowed


async def test_target_refuses_oversized_input_before_tokenizing(mesh):
    stub = mesh.target_stub()
    for prompt, stop, field in (("z" * 4001, [], "prompt"), ("ok", ["a"] * 17, "sampling.stop"),
                                ("ok", ["b" * 257], "sampling.stop[0]")):
        error = await _error(stub.Generate(target_service_pb2.TargetServiceGenerateRequest(
            prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=2, stop=stop))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _fields(error) == [field]
    assert mesh.tokenize_calls == []


async def test_tokenizing_a_prompt_does_not_block_other_requests(tiny_llama_dir):
    """While one prompt is being tokenized, another tenant's request is served start to end."""
    mesh = await start_mesh(tiny_llama_dir)
    entered, gate, seen = threading.Event(), threading.Event(), {}
    tokenize = mesh.engine.tokenize

    def slow_tokenize(prompt):
        if prompt.startswith("BIG"):
            entered.set()
            seen["released_by_the_test"] = gate.wait(10)  # on the event loop, this would block all
        return tokenize(prompt)
    mesh.engine.tokenize = slow_tokenize
    try:
        big = asyncio.ensure_future(collect(mesh.router_stub, request("BIG question", 2)))
        assert await asyncio.to_thread(entered.wait, 10)
        _, _, last = await collect(mesh.router_stub, request("small", 3), metadata=AUTH_B)
        assert last.usage.completion_tokens == 3
        gate.set()
        await big
        assert seen["released_by_the_test"] is True
    finally:
        gate.set()
        await mesh.stop()


# ---- stop matching ------------------------------------------------------------------
def _reference(stops: list[str], text: str) -> int | None:
    """Start of the first stop to end in `text` (ties: the longest), by brute force."""
    best = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or (i + len(s), -len(s)) < best):
            best = (i + len(s), -len(s))
    return None if best is None else best[0] + best[1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abé😀", min_size=1, max_size=4), min_size=1, max_size=6),
       st.lists(st.text("abé😀x", max_size=5), max_size=8))
def test_stop_matcher_finds_what_brute_force_finds_across_chunks(stops, chunks):
    matcher, text, found = StopMatcher(tuple(stops)), "", None
    for chunk in chunks:
        index = matcher.feed(chunk)
        text += chunk
        if index is not None:
            found = index
            break
    assert found == _reference(stops, text)


def test_stop_matching_across_pieces_with_100000_stop_sequences():
    """Pieces of 3 characters; the stop sequence spans pieces and is found once, where it starts.
    (Per-token time against the number of stops: benchmarks/stop_matching.py.)"""
    stops = tuple(f"stop-{i:06d}" for i in range(100_000))
    matcher = StopMatcher(stops)
    text = "lorem ipsum " * 200 + "stop-099999 tail"
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    hits = [matcher.feed(piece) for piece in pieces]
    assert [h for h in hits if h is not None] == [text.index("stop-099999")]
