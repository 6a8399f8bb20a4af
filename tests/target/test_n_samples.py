"""n samples of one prompt through real router and target servers: one prefill (counted), each
sample equal to an independent request with its derived seed, outputs interleaved by index,
cancellation frees every sample's blocks, bad n refused naming the field."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from specmesh.proto.v1 import common_pb2, target_service_pb2
from tests.mesh import AUTH_A, collect, request, start_mesh

# 25 tokens with block_size 4: the last prompt block is partial, so the samples copy it on write.
PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old fisherman"


async def _samples(stub, req) -> tuple[dict[int, list[int]], dict[int, str], list[int], common_pb2.GenerateChunk]:
    """(tokens per index, finish reason per index, index of each chunk in order, final chunk)."""
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    order, last = [], None
    async for response in stub.Generate(req, metadata=AUTH_A):
        chunk = response.chunk
        tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
        order.append(chunk.index)
        if chunk.finish_reason:
            assert chunk.index not in finish, "a sample finished twice"
            finish[chunk.index] = common_pb2.FinishReason.Name(chunk.finish_reason)
        last = chunk
    return tokens, finish, order, last


@pytest.fixture
async def mesh(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, max_samples=8)
    try:
        yield mesh
    finally:
        await mesh.stop()


async def test_four_samples_prefill_once_and_each_equals_a_request_with_its_seed(mesh):
    prompt_len = len(mesh.engine.tokenize(PROMPT))
    assert prompt_len % 4 != 0
    before = mesh.engine.stats().prompt_tokens_computed
    tokens, finish, order, last = await _samples(
        mesh.router_stub, request(PROMPT, 16, temperature=1.0, seed=41, has_seed=True, n=4))
    assert mesh.engine.stats().prompt_tokens_computed - before == prompt_len  # once, not 4 times
    assert sorted(tokens) == [0, 1, 2, 3] and sorted(finish) == [0, 1, 2, 3]
    for i, reason in finish.items():  # each ends on its own: max_tokens, or a sampled end of sequence
        assert (reason, len(tokens[i])) == ("FINISH_REASON_LENGTH", 16) or (
            reason == "FINISH_REASON_STOP" and tokens[i][-1] in mesh.engine.spec.eos_token_ids), (i, reason)
    assert len(set(map(tuple, tokens.values()))) > 1  # different seeds, different samples
    assert order[:4] != [order[0]] * 4  # streamed interleaved, not one sample after the other
    assert last.usage.prompt_tokens == prompt_len  # once
    assert last.usage.completion_tokens == sum(map(len, tokens.values()))
    for i in range(4):  # an independent request seeded with seed + i gives sample i
        alone, _, _ = await collect(mesh.router_stub, request(PROMPT, 16, temperature=1.0, seed=41 + i,
                                                              has_seed=True))
        assert alone == tokens[i], i
    stats = mesh.engine.stats()
    assert stats.used_blocks == 0 and not mesh.engine.live_request_ids()


async def test_greedy_samples_equal_the_greedy_answer_and_end_on_their_own(mesh):
    expected, _, _ = await collect(mesh.router_stub, request(PROMPT, 10))
    tokens, finish, _, last = await _samples(mesh.router_stub, request(PROMPT, 10, n=3))
    assert tokens == {0: expected, 1: expected, 2: expected}
    assert sorted(finish) == [0, 1, 2]
    assert last.usage.completion_tokens == 30 and last.usage.prompt_tokens == len(mesh.engine.tokenize(PROMPT))


async def test_cancelling_a_request_frees_every_samples_blocks(mesh):
    call = mesh.router_stub.Generate(request(PROMPT, 200, temperature=1.0, n=4), metadata=AUTH_A)
    seen: set[int] = set()
    async for response in call:
        if response.chunk.token_ids:
            seen.add(response.chunk.index)
        if len(seen) == 4:
            break
    assert mesh.engine.stats().used_blocks > 0
    call.cancel()
    for _ in range(200):
        stats = mesh.engine.stats()
        if stats.used_blocks == 0 and not mesh.engine.live_request_ids():
            break
        await asyncio.sleep(0.05)
    assert stats.used_blocks == 0 and stats.running == 0 and not mesh.engine.live_request_ids()
    # The engine goes on serving.
    tokens, finish, _, _ = await _samples(mesh.router_stub, request(PROMPT, 4, n=2))
    assert sorted(finish) == [0, 1] and all(len(t) == 4 for t in tokens.values())


def _violations(exc: grpc.aio.AioRpcError) -> list[str]:
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                bad = error_details_pb2.BadRequest()
                if detail.Unpack(bad):
                    return [v.field for v in bad.field_violations]
    return []


@pytest.mark.parametrize("sampling, field", [
    (dict(n=9), "sampling.n"),  # over the target's limit (8 here)
    (dict(n=17), "sampling.n"),  # over the router's (16)
    (dict(n=-1), "sampling.n"),
    (dict(n=3, seed=(1 << 64) - 2, has_seed=True, temperature=1.0), "sampling.seed"),  # seed + 2 overflows
])
async def test_bad_n_is_invalid_argument_naming_the_field_at_router_and_target(mesh, sampling, field):
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await collect(mesh.router_stub, request(PROMPT, 4, **sampling))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in exc.value.details()
    assert _violations(exc.value) == [field]
    target = mesh.target_stub()
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        async for _ in target.Generate(target_service_pb2.TargetServiceGenerateRequest(
                prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=4, **sampling))):
            pass
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(exc.value) == [field]
    ids, _, _ = await collect(mesh.router_stub, request(PROMPT, 4))  # still serving
    assert len(ids) == 4


async def test_n_above_the_running_limit_is_refused_by_the_engine(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, max_num_seqs=2)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await collect(mesh.router_stub, request(PROMPT, 4, n=3))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be in 0..2" in exc.value.details()
    finally:
        await mesh.stop()


async def test_each_sample_speculates_on_its_own_and_stays_lossless(tiny_llama_dir):
    from tests.mesh import start_draft
    repeating = "one two three four five six one two three four five six one two three"
    draft = await start_draft(tiny_llama_dir)
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address,
                            speculation={"speculation_method": "prompt_lookup", "speculation_depth": 4})
    try:
        expected, _, _ = await collect(mesh.router_stub, request(repeating, 16))
        tokens, finish, _, last = await _samples(mesh.router_stub, request(repeating, 16, n=3))
        assert tokens == {0: expected, 1: expected, 2: expected}  # greedy: equal to the plain answer
        assert sorted(finish) == [0, 1, 2]
        assert last.usage.proposed_tokens > 0 and last.usage.verify_passes >= 3  # every sample verified
        assert not mesh.engine.live_request_ids()
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)


async def test_samples_under_block_pressure_are_preempted_and_recomputed_exactly(tiny_llama_dir):
    expected = {}
    mesh = await start_mesh(tiny_llama_dir, num_blocks=24, enable_prefix_caching=False)
    try:
        for i in range(3):
            expected[i], _, _ = await collect(mesh.router_stub, request(PROMPT, 40, temperature=1.0,
                                                                        seed=5 + i, has_seed=True))
        # 3 samples of 25 + 40 tokens need 3 x 17 blocks of 4 (prompt blocks shared): 24 force preemption.
        tokens, finish, _, _ = await _samples(mesh.router_stub, request(PROMPT, 40, temperature=1.0, seed=5,
                                                                       has_seed=True, n=3))
        assert tokens == expected
        assert mesh.engine.stats().num_preemptions > 0
        assert mesh.engine.stats().used_blocks == 0
    finally:
        await mesh.stop()


async def test_admission_counts_the_samples(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, max_num_seqs=4, max_queued_requests=0)
    try:
        # min_tokens: no sample may end early (a sampled end of sequence would free a place)
        call = mesh.router_stub.Generate(request(PROMPT, 200, temperature=1.0, n=4, min_tokens=200),
                                         metadata=AUTH_A)
        await call.read()  # admitted and streaming: its 4 samples fill the 4 places
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await collect(mesh.router_stub, request(PROMPT, 4))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()
        for _ in range(200):
            if not mesh.engine.live_request_ids():
                break
            await asyncio.sleep(0.05)
        ids, _, _ = await collect(mesh.router_stub, request(PROMPT, 4))  # room again
        assert len(ids) == 4
    finally:
        await mesh.stop()
