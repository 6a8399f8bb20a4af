"""The OpenAI-compatible gateway, driven by the official `openai` client against a tiny mesh:
chat and completions, streaming and not; errors as OpenAI-style JSON with the right status."""

from __future__ import annotations

import grpc
import openai
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from services.common.models.tiny import build_tiny_model
from specmesh.proto.v1 import common_pb2, router_service_pb2
from services.gateway.app import Gateway, GatewayConfig
from services.gateway.openai_api import grpc_error
from tests.mesh import TOKEN_A, collect, first_sample, start_mesh

pytestmark = pytest.mark.asyncio(loop_scope="module")  # one mesh for the module
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-chat"), arch="llama", seed=3, chat=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def front(chat_dir):
    mesh = await start_mesh(chat_dir)
    gateway = Gateway(GatewayConfig(port=0, router_address=mesh.router.address))
    await gateway.start()
    client = openai.AsyncOpenAI(base_url=f"http://{gateway.address}/v1", api_key=TOKEN_A, max_retries=0)
    try:
        yield mesh, gateway, client
    finally:
        await client.close()
        await gateway.stop()
        await mesh.stop()


async def test_chat_completion_streaming_and_not(front):
    mesh, _, client = front
    _, expected, _ = await collect(mesh.router_stub, router_service_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(**m) for m in QUESTION],
        sampling=common_pb2.SamplingParams(max_tokens=12)))

    full = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=12,
                                                temperature=0)
    assert full.object == "chat.completion" and full.model == "default"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0

    stream = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=12,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    events = [event async for event in stream]
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == expected
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 12


async def test_completion_streaming_and_not(front):
    mesh, _, client = front
    _, expected, _ = await collect(mesh.router_stub, router_service_pb2.GenerateRequest(
        prompt="The quick brown fox", sampling=common_pb2.SamplingParams(max_tokens=10)))

    full = await client.completions.create(model="default", prompt="The quick brown fox", max_tokens=10,
                                           temperature=0)
    assert full.object == "text_completion"
    assert full.choices[0].text == expected and full.choices[0].finish_reason == "length"

    stream = await client.completions.create(model="default", prompt="The quick brown fox", max_tokens=10,
                                             temperature=0, stream=True)
    assert "".join([e.choices[0].text async for e in stream]) == expected


async def test_models_lists_the_routers_pools(front):
    _, _, client = front
    models = await client.models.list()
    assert [m.id for m in models.data] == ["default"]


async def test_errors_are_openai_style_with_the_right_status(front):
    _, gateway, client = front
    # The gateway's own check, before the router is called.
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="default", messages=[], max_tokens=4)
    assert exc.value.status_code == 400
    assert exc.value.body == {"message": "'messages' must be a non-empty list of {role, content}",
                              "type": "invalid_request_error", "param": "messages", "code": None}
    # The router's INVALID_ARGUMENT (max_tokens above its limit of 256).
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=100000)
    assert exc.value.body["type"] == "invalid_request_error"
    assert exc.value.body["code"] == "invalid_argument"
    assert "max_tokens 100000 is above the limit 256" in exc.value.body["message"]
    # A wrong token: the router's UNAUTHENTICATED, streaming or not.
    wrong = openai.AsyncOpenAI(base_url=f"http://{gateway.address}/v1", api_key="wrong", max_retries=0)
    try:
        for stream in (False, True):
            with pytest.raises(openai.AuthenticationError) as exc:
                await wrong.chat.completions.create(model="default", messages=QUESTION, max_tokens=4,
                                                    stream=stream)
            assert exc.value.status_code == 401
            assert exc.value.body["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
    finally:
        await wrong.close()


@pytest.mark.parametrize("code, status, kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout"),
    (grpc.StatusCode.INTERNAL, 500, "api_error"),
])
async def test_status_mapping(code, status, kind):
    trailing = grpc.aio.Metadata(("grpc-retry-pushback-ms", "1500"))
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details="why")
    got_status, body, headers = grpc_error(error)
    assert (got_status, body["error"]["type"], body["error"]["message"]) == (status, kind, "why")
    assert headers == {"Retry-After": "2"}


# ---- special tokens: skipped in the text by default, shown with skip_special_tokens=false ----


async def _control_sample(mesh, tokenizer, make_request) -> tuple[int, list[int]]:
    """(seed, ids) of a sampled answer with a control token (<pad>, <bos>, <unk> or
    <start_of_turn>) mid-stream that runs to max_tokens."""
    control = set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids("<start_of_turn>")}
    ends = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")}

    def has_a_control_token_mid_stream(ids):
        return not ends & set(ids) and any(t in control for t in ids[1:-1])

    return await first_sample(mesh.router_stub, make_request, has_a_control_token_mid_stream)


async def test_special_tokens_are_skipped_unless_asked_on_both_endpoints(front, chat_dir):
    mesh, _, client = front
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    prompt, max_tokens = "Once upon a time", 24

    def sampling(seed):
        return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, has_seed=True)

    seed, ids = await _control_sample(mesh, tokenizer, lambda s: router_service_pb2.GenerateRequest(
        prompt=prompt, sampling=sampling(s)))
    skipped, shown = (tokenizer.decode(ids, skip_special_tokens=skip) for skip in (True, False))
    assert skipped != shown
    args = dict(model="default", prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=seed)
    stream = await client.completions.create(**args, stream=True)
    assert "".join([e.choices[0].text async for e in stream]) == skipped
    full = await client.completions.create(**args, extra_body={"skip_special_tokens": False})
    assert full.choices[0].text == shown

    seed, ids = await _control_sample(mesh, tokenizer, lambda s: router_service_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(**m) for m in QUESTION], sampling=sampling(s)))
    skipped, shown = (tokenizer.decode(ids, skip_special_tokens=skip) for skip in (True, False))
    args = dict(model="default", messages=QUESTION, max_tokens=max_tokens, temperature=1.0, seed=seed)
    full = await client.chat.completions.create(**args)
    assert full.choices[0].message.content == skipped
    stream = await client.chat.completions.create(**args, stream=True, extra_body={"skip_special_tokens": False})
    assert "".join([e.choices[0].delta.content or "" async for e in stream]) == shown


async def test_skip_special_tokens_must_be_a_boolean(front):
    _, _, client = front
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model="default", prompt="hi", max_tokens=4,
                                        extra_body={"skip_special_tokens": "no"})
    assert exc.value.body["param"] == "skip_special_tokens"
