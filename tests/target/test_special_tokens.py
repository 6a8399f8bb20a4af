"""Control tokens sampled mid-stream leave no trace in the text a client reads (the ids
still stream), `skip_special_tokens=False` shows them, a stop sequence spanning one still
matches, and a sampled end-of-sequence token still ends the request — through the router
and target gRPC servers. The samples are real: seeds found by search (tests.mesh.first_sample)."""

from __future__ import annotations

import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from specmesh.proto.v1 import common_pb2
from tests.mesh import collect, first_sample, request, start_mesh

pytestmark = pytest.mark.asyncio(loop_scope="module")  # one mesh for the module
PROMPT = "Once upon a time"
MAX_TOKENS = 24


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        yield mesh
    finally:
        await mesh.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def control_sample(mesh, tokenizer) -> tuple[int, list[int]]:
    """(seed, ids) of a sample with a control token mid-stream (<pad>, <bos> or <unk>)."""
    def has_a_control_token_mid_stream(ids):
        return spanning_stop(tokenizer, ids) is not None

    return await first_sample(mesh.router_stub, sampled, has_a_control_token_mid_stream)


def sampled(seed: int, **options):
    return request(PROMPT, MAX_TOKENS, temperature=1.0, seed=seed, has_seed=True, **options)


def spanning_stop(tokenizer, ids: list[int]) -> tuple[str, int, int] | None:
    """(stop, its start in the skipped text, the control token's index): a 2-character stop
    sequence made of the characters on either side of a control token mid-stream; None
    when `ids` have no such place (or end the request with end-of-sequence)."""
    if tokenizer.eos_token_id in ids:
        return None
    text = tokenizer.decode(ids, skip_special_tokens=True)
    shown = tokenizer.decode(ids, skip_special_tokens=False)
    for at, token in enumerate(ids):
        if token not in tokenizer.all_special_ids:
            continue
        start = len(tokenizer.decode(ids[:at], skip_special_tokens=True)) - 1
        stop = text[start:start + 2] if start >= 0 else ""
        if len(stop) == 2 and "\ufffd" not in stop and text.find(stop) == start and stop not in shown:
            return stop, start, at
    return None


async def test_control_tokens_stream_as_ids_but_never_as_text(mesh, tokenizer, control_sample):
    seed, ids = control_sample
    control = [t for t in ids if t in tokenizer.all_special_ids]

    got_ids, text, last = await collect(mesh.router_stub, sampled(seed))
    assert got_ids == ids
    assert text == tokenizer.decode([t for t in ids if t not in control])
    assert not any(tokenizer.convert_ids_to_tokens(t) in text for t in control)
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH

    shown_ids, shown, _ = await collect(mesh.router_stub, sampled(seed, skip_special_tokens=False))
    assert shown_ids == ids
    assert shown == tokenizer.decode(ids, skip_special_tokens=False)
    assert all(tokenizer.convert_ids_to_tokens(t) in shown for t in control)


async def test_a_stop_sequence_spanning_a_control_token_matches(mesh, tokenizer, control_sample):
    seed, ids = control_sample
    stop, start, at = spanning_stop(tokenizer, ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)

    got_ids, got, last = await collect(mesh.router_stub, sampled(seed, stop=[stop]))
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP_SEQUENCE
    assert got == text[:start]
    assert len(got_ids) > at + 1 and got_ids == ids[:len(got_ids)]  # the control token streamed

    # Shown, the control token's text sits inside the stop: the client's text never holds it.
    _, shown, last = await collect(mesh.router_stub, sampled(seed, stop=[stop], skip_special_tokens=False))
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert shown == tokenizer.decode(ids, skip_special_tokens=False)


async def test_a_sampled_end_of_sequence_token_ends_the_request_and_is_never_text(mesh, tokenizer):
    def ends_with_end_of_sequence(ids):
        return len(ids) > 1 and ids[-1] == tokenizer.eos_token_id

    seed, ids = await first_sample(mesh.router_stub, sampled, ends_with_end_of_sequence)
    for skip in (True, False):
        got_ids, text, last = await collect(mesh.router_stub, sampled(seed, skip_special_tokens=skip))
        assert got_ids == ids
        assert last.finish_reason == common_pb2.FINISH_REASON_STOP
        assert text == tokenizer.decode(ids[:-1], skip_special_tokens=skip)
        assert tokenizer.eos_token not in text
