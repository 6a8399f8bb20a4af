"""DraftService over real gRPC on loopback (every method), and the prompt lookup proposer itself."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.proto.v1 import (
    common_pb2,
    draft_service_pb2,
    draft_service_pb2_grpc,
)
from services.common.server import GrpcServer
from services.draft.app import build_draft_server
from services.draft.config import DraftConfig
from services.draft.proposers import DraftTree, PromptLookupProposer
from services.draft.service import SERVICE_NAME, DraftService, add_to_server
from services.draft.state import DraftStateStore

PL = common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def seq(sequence_id: str, tokens=(), depth: int = 4, nodes: int = 0, method: int = PL, salt: str = "t1"):
    return draft_service_pb2.DraftSequence(sequence_id=sequence_id, new_token_ids=list(tokens),
                                           method=method, max_depth=depth, max_nodes=nodes,
                                           tenant_salt=salt)


def request(*sequences, step: int = 0):
    return draft_service_pb2.ProposeRequest(sequences=list(sequences), step=step)


def chain_of(tree) -> list[int]:
    assert list(tree.parents) == list(range(-1, len(tree.token_ids) - 1))
    return list(tree.token_ids)


async def _serve(config: DraftConfig):
    server = build_draft_server(config)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    return server, channel


@pytest.fixture
async def draft():
    server, channel = await _serve(DraftConfig())
    yield draft_service_pb2_grpc.DraftServiceStub(channel)
    await channel.close()
    await server.stop(0)


async def propose(stub, *sequences) -> list[list[int]]:
    response = await stub.Propose(request(*sequences))
    assert [t.sequence_id for t in response.trees] == [s.sequence_id for s in sequences]
    return [chain_of(tree) for tree in response.trees]


async def expect_status(call, code=INVALID, text: str | None = None):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    if text is not None:
        assert text in info.value.details()
    return info.value.details()


# ---- prompt lookup: exact token ids ---------------------------------------------------------

async def test_prompt_lookup_exact_tokens(draft):
    got = await propose(
        draft,
        seq("repeat", [1, 2, 3, 4, 5, 1, 2, 3], depth=4),
        # 3-gram [1,2,3] matches at 0 (-> 9,2,3,7) although 2-gram [2,3] matches later at 4.
        seq("longer", [1, 2, 3, 9, 2, 3, 7, 1, 2, 3], depth=4),
        # [5,6,7] occurs at 0 and 5: the most recent earlier occurrence (5) wins.
        seq("recent", [5, 6, 7, 8, 8, 5, 6, 7, 9, 9, 5, 6, 7], depth=2),
        seq("depth", [1, 2, 3, 4, 5, 1, 2, 3], depth=2),
        seq("nodes", [1, 2, 3, 4, 5, 1, 2, 3], depth=4, nodes=3),
        # Only the 1-gram [1] matches (at 1); proposal stops at the end of the history.
        seq("unigram", [4, 1, 5, 6, 1], depth=8),
        seq("nomatch", [1, 2, 3, 4], depth=4),
        seq("single", [7], depth=4),
        seq("overlap", [1, 1, 1, 1], depth=4),
    )
    assert got == [[4, 5, 1, 2], [9, 2, 3, 7], [9, 9], [4, 5], [4, 5, 1], [5, 6, 1], [], [], [1]]


async def test_unspecified_method_is_prompt_lookup(draft):
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 1, 5]
    got = await propose(draft, seq("a", tokens), seq("b", tokens, method=common_pb2.SPECULATION_METHOD_UNSPECIFIED))
    assert got == [[9, 2, 6, 1], [9, 2, 6, 1]]


async def test_incremental_equals_one_shot(draft):
    rng = random.Random(7)
    tokens = [rng.randrange(6) for _ in range(120)]
    cuts = [0, 30, 31, 33, 50, 51, 80, 97, 120]
    for i, (start, end) in enumerate(zip(cuts, cuts[1:])):
        incremental, one_shot = await propose(draft, seq("inc", tokens[start:end], depth=5),
                                              seq(f"shot{i}", tokens[:end], depth=5))
        assert incremental == one_shot == reference_prompt_lookup(tokens[:end], 5)
    # A known sequence may come with no new tokens: the same proposal again.
    assert await propose(draft, seq("inc", [], depth=5)) == [reference_prompt_lookup(tokens, 5)]


async def test_propose_stream_answers_each_request_in_order(draft):
    call = draft.ProposeStream()
    steps = [
        (request(seq("s", [1, 2, 3, 1, 2]), step=10), [3, 1, 2]),
        (request(seq("s", [3]), step=11), [1, 2, 3]),
        (request(seq("s", [9]), step=12), []),
        (request(seq("s", [9]), seq("t", [5, 5]), step=13), [9]),
    ]
    for message, expected in steps:
        await call.write(message)
        response = await call.read()
        assert response.step == message.step
        assert chain_of(response.trees[0]) == expected
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


async def test_propose_stream_bad_sequence_gets_no_tree_and_the_stream_goes_on(draft):
    call = draft.ProposeStream()
    await call.write(request(seq("s", [1, 2, 1])))
    assert chain_of((await call.read()).trees[0]) == [2, 1]
    await call.write(request(seq("s", [1], depth=0)))  # refused alone: no tree, nothing kept
    assert list((await call.read()).trees) == []
    await call.write(request(seq("s", [])))
    assert chain_of((await call.read()).trees[0]) == [2, 1]  # the bad message changed nothing
    await call.write(request())  # a message without sequences still ends the stream
    await expect_status(call.read(), INVALID, "no sequences")
    assert await call.code() == INVALID
    assert await propose(draft, seq("s", [])) == [[2, 1]]


async def test_release_drops_state(draft):
    await propose(draft, seq("a", [1, 2, 1]), seq("b", [4, 4]))
    response = await draft.Release(draft_service_pb2.ReleaseRequest(sequence_ids=["a", "zzz"]))
    assert (response.released, response.unknown) == (1, 1)
    await expect_status(draft.Propose(request(seq("a", []))), INVALID, "unknown sequence")
    assert await propose(draft, seq("b", [])) == [[4]]
    # A released id can be opened again from scratch.
    assert await propose(draft, seq("a", [8, 9, 8])) == [[9, 8]]


# ---- bad input: INVALID_ARGUMENT, nothing changed --------------------------------------------

def _sampled(message, **sampling):
    for name, value in sampling.items():
        setattr(message, name, value)
    return message


BAD_REQUESTS = {
    "no sequences": (request(), "no sequences"),
    "empty id": (request(seq("", [1, 2])), "sequence_id is empty"),
    "duplicate ids": (request(seq("dup", [1]), seq("dup", [2])), "duplicate sequence_id"),
    "depth zero": (request(seq("x", [1], depth=0)), "max_depth 0"),
    "depth negative": (request(seq("x", [1], depth=-3)), "max_depth -3"),
    "depth over limit": (request(seq("x", [1], depth=17)), "max_depth 17"),
    "nodes negative": (request(seq("x", [1], nodes=-1)), "max_nodes -1"),
    "nodes over limit": (request(seq("x", [1], nodes=65)), "max_nodes 65"),
    "new sequence without tokens": (request(seq("x", [])), "unknown sequence"),
    "negative token": (request(seq("x", [1, -2, 3])), "negative token"),
    "off": (request(seq("x", [1], method=common_pb2.SPECULATION_METHOD_OFF)), "not supported"),
    "unknown method": (request(seq("x", [1], method=99)), "method 99 not supported"),
    "history too long (new)": (request(seq("x", [1] * 65537)), "above the limit of 65536"),
    "history too long (append)": (request(seq("subject", [1] * 65531)), "history of 65537 tokens"),
    "negative temperature": (request(_sampled(seq("x", [1]), temperature=-0.5)), "temperature -0.5"),
    "NaN temperature": (request(_sampled(seq("x", [1]), temperature=float("nan"))), "temperature nan"),
    "negative top_k": (request(_sampled(seq("x", [1]), top_k=-1)), "top_k -1"),
    "top_p above 1": (request(_sampled(seq("x", [1]), top_p=1.5)), "top_p 1.5"),
}
PROMPT = [1, 2, 3, 4, 1, 2]


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
async def test_bad_request_is_invalid_argument_and_changes_nothing(draft, name):
    bad, text = BAD_REQUESTS[name]
    await propose(draft, seq("subject", PROMPT), seq("control", PROMPT))
    # The bad request also carries good parts: tokens for "subject" and a new sequence.
    bad = draft_service_pb2.ProposeRequest.FromString(bad.SerializeToString())
    if bad.sequences:
        bad.sequences.extend([seq("fresh", [5, 6]), seq("subject", [9, 9])] if name != "duplicate ids"
                             else [])
        if name == "history too long (append)":
            del bad.sequences[-1]
    await expect_status(draft.Propose(bad), INVALID, text)
    # Same answer as without the bad request; the new sequence was not opened.
    assert await propose(draft, seq("subject", [3]), seq("control", [3])) == [[4, 1, 2, 3]] * 2
    await expect_status(draft.Propose(request(seq("fresh", []))), INVALID, "unknown sequence")


async def test_other_tenant_is_permission_denied(draft):
    await propose(draft, seq("s", [1, 2, 1], salt="tenant-a"))
    details = await expect_status(draft.Propose(request(seq("s", [2], salt="tenant-b"))),
                                  grpc.StatusCode.PERMISSION_DENIED, "another tenant")
    assert "tenant-a" not in details and "tenant-b" not in details
    assert await propose(draft, seq("s", [], salt="tenant-a")) == [[2, 1]]


async def test_too_many_open_sequences_is_resource_exhausted():
    server, channel = await _serve(DraftConfig(max_sequences=2))
    stub = draft_service_pb2_grpc.DraftServiceStub(channel)
    try:
        await propose(stub, seq("a", [1]), seq("b", [2]))
        await expect_status(stub.Propose(request(seq("a", [1]), seq("c", [3]))),
                            grpc.StatusCode.RESOURCE_EXHAUSTED, "open sequences")
        assert await propose(stub, seq("a", [1])) == [[1]]  # the refused request changed nothing
        await stub.Release(draft_service_pb2.ReleaseRequest(sequence_ids=["b"]))
        assert await propose(stub, seq("c", [3, 3])) == [[3]]
    finally:
        await channel.close()
        await server.stop(0)


async def test_draining_server_answers_unavailable():
    service = DraftService(DraftConfig())
    server = GrpcServer(DraftConfig().server, lambda s: add_to_server(s, service), [SERVICE_NAME],
                        on_drain=service.drain)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    stub = draft_service_pb2_grpc.DraftServiceStub(channel)
    try:
        assert await propose(stub, seq("s", [1, 1])) == [[1]]
        await service.drain()
        await expect_status(stub.Propose(request(seq("s", [1]))), grpc.StatusCode.UNAVAILABLE, "shutting down")
    finally:
        await channel.close()
        await server.stop(0)


# ---- server plumbing -------------------------------------------------------------------------

async def test_health_serving_and_span_attributes(spans):  # `spans`: tests/conftest.py
    server, channel = await _serve(DraftConfig())
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = draft_service_pb2_grpc.DraftServiceStub(channel)
        traced = seq("s", [11, 12, 13, 11, 12])
        traced.traceparent = f"00-{'ab' * 16}-{'cd' * 8}-01"  # the target's request span
        assert await propose(stub, traced, seq("t", [21])) == [[13, 11, 12], []]
        assert await propose(stub, seq("s", [13])) == [[11, 12, 13]]
        await stub.Release(draft_service_pb2.ReleaseRequest(sequence_ids=["s", "t"]))
    finally:
        await channel.close()
        await server.stop(0)
    # One span per traced sequence, in the request's trace, ended at Release; none per step.
    assert not [s for s in spans.get_finished_spans() if s.name == "draft.propose"]
    proposals = [s for s in spans.get_finished_spans() if s.name == "draft.sequence"]
    assert len(proposals) == 1
    assert proposals[0].context.trace_id == int("ab" * 16, 16)
    assert proposals[0].parent.span_id == int("cd" * 8, 16)
    assert proposals[0].resource.attributes["service.name"].endswith("draft")
    attributes = dict(proposals[0].attributes)
    assert attributes["specmesh.draft.proposals"] == 2
    assert attributes["specmesh.proposed_tokens"] == 6
    for span in proposals:
        for value in span.attributes.values():
            assert not isinstance(value, (list, tuple)), "token contents must not be recorded"


def test_config_is_validated():
    for bad in (dict(max_depth_limit=0), dict(max_nodes_limit=-1), dict(max_history_tokens=0),
                dict(max_sequences=0), dict(prompt_lookup_min_ngram=0),
                dict(prompt_lookup_min_ngram=4, prompt_lookup_max_ngram=3), dict(suffix_max_match=0),
                dict(suffix_tenant_max_tokens=0), dict(suffix_max_tenants=0), dict(suffix_max_occurrences=0),
                dict(draft_model_dtype="int8"), dict(draft_model_prefill_chunk=0), dict(dynamic_tree_top_k=0)):
        with pytest.raises(ValueError):
            DraftConfig(**bad)
    assert DraftConfig(draft_model_dir="~/m").draft_model_dir == Path("~/m").expanduser()


# ---- the proposer and the draft tree, without gRPC -------------------------------------------

def reference_prompt_lookup(tokens: list[int], depth: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Brute force: longest n first, most recent earlier occurrence, up to `depth` tokens after it."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + depth]
    return []


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_prompt_lookup_matches_brute_force(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    store, proposer = DraftStateStore(), PromptLookupProposer(max_ngram, min_ngram)
    for s in range(6):
        vocab = [3, 5, 20, 1000][s % 4]
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 400))]
        sid, pos = f"seq{s}", 0
        while pos < len(tokens):
            chunk = tokens[pos:pos + rng.choice([1, 1, 2, 5, 40])]
            pos += len(chunk)
            state = store.append(sid, chunk, "", PL)
            proposer.observe(sid, chunk)
            depth = rng.randrange(1, 9)
            [tree] = proposer.propose([state], depth, 64)
            assert list(tree.token_ids) == reference_prompt_lookup(tokens[:pos], depth, max_ngram, min_ngram)


def test_prompt_lookup_long_sequence_stays_exact():
    rng = random.Random(3)
    store, proposer = DraftStateStore(), PromptLookupProposer()
    tokens = [rng.randrange(50) for _ in range(6000)]
    state = store.append("long", tokens, "", PL)
    proposer.observe("long", tokens)
    for step in range(300):  # generated tokens copy a span of the prompt, as in summaries
        new = tokens[1000 + step:1001 + step]
        state = store.append("long", new, "", PL)
        proposer.observe("long", new)
        [tree] = proposer.propose([state], 8, 8)
        assert list(tree.token_ids) == reference_prompt_lookup(list(state.token_ids), 8)
    proposer.release("long")
    with pytest.raises(RuntimeError, match="observe"):
        proposer.propose([state], 4, 4)


def test_draft_tree_is_validated():
    tree = DraftTree.chain("s", [5, 6, 7])
    assert tree.parents == (-1, 0, 1) and tree.depths == (1, 2, 3)
    branched = DraftTree("s", (5, 6, 7), (-1, -1, 0))
    assert branched.depths == (1, 1, 2)
    assert DraftTree.from_proto(branched.to_proto()) == branched
    with pytest.raises(ValueError):
        DraftTree("s", (5, 6), (-1,))
    with pytest.raises(ValueError):
        DraftTree("s", (5, 6), (-1, 1))  # a node cannot be its own parent


# ---- suffix decoding over gRPC ----------------------------------------------------------------

SUFFIX = common_pb2.SPECULATION_METHOD_SUFFIX
DM = common_pb2.SPECULATION_METHOD_DRAFT_MODEL
DT = common_pb2.SPECULATION_METHOD_DYNAMIC_TREE


async def test_suffix_tree_and_tenant_isolation(draft):
    branch = seq("b", [7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2, 3, 6, 1], depth=3, nodes=4, method=SUFFIX)
    [tree] = (await draft.Propose(request(branch))).trees
    assert (list(tree.token_ids), list(tree.parents)) == ([2, 3, 4, 6], [-1, 0, 0, 1])
    # Tenant a's released output is proposed to tenant a, never to tenant b.
    await draft.Propose(request(seq("a1", [10, 11, 12], method=SUFFIX, salt="a")))
    await draft.Propose(request(seq("a1", [20, 21, 22, 23, 24], method=SUFFIX, salt="a")))
    await draft.Release(draft_service_pb2.ReleaseRequest(sequence_ids=["a1"]))
    got = await propose(draft, seq("a2", [30, 21], method=SUFFIX, salt="a"),
                        seq("b2", [30, 21], method=SUFFIX, salt="b"))
    assert got == [[22, 23, 24], []]


# ---- draft model and dynamic tree over gRPC ----------------------------------------------------

async def test_model_methods_without_draft_model_are_failed_precondition(draft):
    await propose(draft, seq("subject", PROMPT), seq("control", PROMPT))
    for method in (DM, DT):
        bad = request(seq("fresh", [5, 6]), seq("subject", [9, 9]), seq("x", [1], method=method))
        details = await expect_status(draft.Propose(bad), grpc.StatusCode.FAILED_PRECONDITION,
                                      "DraftConfig(draft_model_dir=")
        assert common_pb2.SpeculationMethod.Name(method) in details
    assert await propose(draft, seq("subject", [3]), seq("control", [3])) == [[4, 1, 2, 3]] * 2
    await expect_status(draft.Propose(request(seq("fresh", []))), INVALID, "unknown sequence")
    # Bad input still wins over the missing model.
    await expect_status(draft.Propose(request(seq("x", [1], method=DM), seq("y", [1], depth=0))),
                        INVALID, "max_depth 0")


@pytest.fixture
async def model_draft(tiny_llama_dir):
    server, channel = await _serve(DraftConfig(draft_model_dir=tiny_llama_dir, draft_model_dtype="float32",
                                               dynamic_tree_top_k=3))
    yield draft_service_pb2_grpc.DraftServiceStub(channel)
    await channel.close()
    await server.stop(0)


def _hf_greedy(model_dir, tokens, num_tokens):
    import torch

    from services.common.models.loading import load_causal_lm
    model, _ = load_causal_lm(model_dir, torch.float32)
    ids = torch.tensor([tokens])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                         min_new_tokens=num_tokens, do_sample=False)
    return out[0, len(tokens):].tolist()


async def test_every_method_in_one_request(model_draft, tiny_llama_dir):
    prompt = [1, 40, 41, 42, 43, 40, 41]
    greedy = _hf_greedy(tiny_llama_dir, prompt, 4)
    response = await model_draft.Propose(request(
        seq("pl", prompt, method=PL), seq("dm", prompt, method=DM), seq("sx", prompt, method=SUFFIX),
        seq("dt", prompt, method=DT, depth=4, nodes=12), seq("dm2", prompt, method=DM, depth=2)))
    pl, dm, sx, dt, dm2 = response.trees
    assert [t.sequence_id for t in response.trees] == ["pl", "dm", "sx", "dt", "dm2"]
    assert chain_of(pl) == chain_of(sx) == [42, 43, 40, 41]
    assert chain_of(dm) == greedy and chain_of(dm2) == greedy[:2]
    tree = DraftTree.from_proto(dt)
    assert 4 < tree.num_nodes <= 12 and max(tree.depths) == 4
    assert list(tree.token_ids[:4]) == greedy and list(tree.parents[:4]) == [-1, 0, 1, 2]  # greedy path first


async def test_draft_model_stream_rolls_back_on_rejection(model_draft, tiny_llama_dir):
    prompt = [1, 50, 51, 52, 53, 54]
    call = model_draft.ProposeStream()
    await call.write(request(seq("s", prompt, method=DM, depth=4), step=1))
    first = chain_of((await call.read()).trees[0])
    assert first == _hf_greedy(tiny_llama_dir, prompt, 4)
    new = first[:2] + [(first[2] + 1) % 384]  # two accepted, then the target's own token
    await call.write(request(seq("s", new, method=DM, depth=4), step=2))
    second = await call.read()
    assert second.step == 2
    assert chain_of(second.trees[0]) == _hf_greedy(tiny_llama_dir, prompt + new, 4)
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_model_bad_input_is_invalid_argument_and_changes_nothing(model_draft):
    first = await propose(model_draft, seq("subject", PROMPT, method=DM))
    bad_requests = [
        (request(seq("fresh", [5, 6], method=DT), seq("subject", [9, 384], method=DM)), "token id 384"),
        (request(seq("fresh", [5, 6], method=DT), seq("subject", [9], method=DM, depth=17)), "max_depth 17"),
        (request(seq("fresh", [5, 6], method=DT), seq("subject", [9], method=DT)), "opened with method"),
    ]
    for bad, text in bad_requests:
        await expect_status(model_draft.Propose(bad), INVALID, text)
    assert await propose(model_draft, seq("subject", [], method=DM)) == first
    await expect_status(model_draft.Propose(request(seq("fresh", [], method=DT))), INVALID, "unknown sequence")
    response = await model_draft.Release(draft_service_pb2.ReleaseRequest(sequence_ids=["subject"]))
    assert (response.released, response.unknown) == (1, 0)
    await expect_status(model_draft.Propose(request(seq("subject", [], method=DM))), INVALID, "unknown sequence")


async def test_concurrent_model_and_lookup_requests_all_get_their_drafts(model_draft, tiny_llama_dir, spans):
    import asyncio

    prompts = {f"m{i}": [1, 60 + i, 61, 62, 60 + i, 61] for i in range(3)}
    calls = [model_draft.Propose(request(seq(sid, tokens, method=DM, depth=3))) for sid, tokens in prompts.items()]
    calls += [model_draft.Propose(request(seq(f"p{i}", [5, 6, 7, 5, 6]))) for i in range(3)]
    responses = await asyncio.gather(*calls)
    for sid, response in zip(prompts, responses):
        assert chain_of(response.trees[0]) == _hf_greedy(tiny_llama_dir, prompts[sid], 3)
    assert all(chain_of(r.trees[0]) == [7, 5, 6] for r in responses[3:])
    # One server span per call, none failed (the draft's per-request spans: test_health_serving_...).
    calls = [s for s in spans.get_finished_spans() if s.name == "/specmesh.v1.DraftService/Propose"]
    assert len(calls) == 6 and all(s.status.is_ok for s in calls)
