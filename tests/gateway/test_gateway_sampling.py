"""Log-probabilities, penalties and logit bias through the gateway with the official `openai`
client, chat and completions, streaming and not: the values are the router's, in OpenAI's
response shapes; wrong values are 400s naming the field."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio

from services.common.models.tiny import build_tiny_model
from services.gateway.app import Gateway, GatewayConfig
from specmesh.proto.v1 import common_pb2, router_service_pb2
from tests.mesh import TOKEN_A, AUTH_A, start_mesh

pytestmark = pytest.mark.asyncio(loop_scope="module")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The quick brown fox"
PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4, logit_bias={"20": 2.5, "31": -4.0})
EXTRA = {"repetition_penalty": 1.3, "min_tokens": 4}


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
        yield mesh, client
    finally:
        await client.close()
        await gateway.stop()
        await mesh.stop()


async def router_answer(mesh, top: int, chat: bool, **sampling):
    """(text, [TokenLogprob]) the router gives for the same request."""
    params = common_pb2.SamplingParams(
        max_tokens=10, logprobs=True, top_logprobs=top, presence_penalty=PENALTIES["presence_penalty"],
        frequency_penalty=PENALTIES["frequency_penalty"], repetition_penalty=EXTRA["repetition_penalty"],
        min_tokens=EXTRA["min_tokens"], logit_bias={int(k): v for k, v in PENALTIES["logit_bias"].items()},
        **sampling)
    req = router_service_pb2.GenerateRequest(sampling=params, **(
        {"messages": [common_pb2.ChatMessage(**m) for m in QUESTION]} if chat else {"prompt": PROMPT}))
    text, logprobs = "", []
    async for response in mesh.router_stub.Generate(req, metadata=AUTH_A):
        text += response.chunk.text
        logprobs.extend(response.chunk.logprobs)
    return text, logprobs


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_and_penalties(front, stream):
    mesh, client = front
    text, want = await router_answer(mesh, 3, chat=True, temperature=0.7, seed=4, has_seed=True)
    kwargs = dict(model="default", messages=QUESTION, max_tokens=10, temperature=0.7, seed=4, logprobs=True,
                  top_logprobs=3, extra_body=EXTRA, **PENALTIES)
    if stream:
        events = [e async for e in await client.chat.completions.create(stream=True, **kwargs)]
        content = "".join(e.choices[0].delta.content or "" for e in events)
        entries = [c for e in events if e.choices[0].logprobs for c in e.choices[0].logprobs.content]
    else:
        full = await client.chat.completions.create(**kwargs)
        content, entries = full.choices[0].message.content, full.choices[0].logprobs.content
    assert content == text
    assert [(e.token, e.logprob) for e in entries] == [(w.token, pytest.approx(w.logprob, abs=1e-4)) for w in want]
    for entry, w in zip(entries, want):
        assert entry.bytes == list(w.token.encode())
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (t.token, pytest.approx(t.logprob, abs=1e-4)) for t in w.top]
        assert len(entry.top_logprobs) == 3


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs_and_penalties(front, stream):
    mesh, client = front
    text, want = await router_answer(mesh, 2, chat=False)  # greedy
    kwargs = dict(model="default", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2,
                  extra_body=EXTRA, **PENALTIES)
    if stream:
        events = [e async for e in await client.completions.create(stream=True, **kwargs)]
        got = "".join(e.choices[0].text for e in events)
        shaped = [e.choices[0].logprobs for e in events if e.choices[0].logprobs]
        tokens = [t for s in shaped for t in s.tokens]
        values = [v for s in shaped for v in s.token_logprobs]
        tops = [d for s in shaped for d in s.top_logprobs]
        offsets = [o for s in shaped for o in s.text_offset]
    else:
        full = await client.completions.create(**kwargs)
        got, lp = full.choices[0].text, full.choices[0].logprobs
        tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    assert got == text
    assert tokens == [w.token for w in want] and values == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert offsets == [sum(len(w.token) for w in want[:i]) for i in range(len(want))]
    for top, w in zip(tops, want):  # the 2 most likely, and the chosen token
        assert top == pytest.approx({**{t.token: t.logprob for t in w.top}, w.token: w.logprob}, abs=1e-4)


async def test_logit_bias_forces_a_token_and_plain_requests_have_no_logprobs(front):
    _, client = front
    forced = await client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0,
                                             logit_bias={"40": 100})
    plain = await client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0)
    assert forced.choices[0].text != plain.choices[0].text
    forced_lp = await client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0,
                                                logit_bias={"40": 100}, logprobs=0)
    assert forced_lp.choices[0].text == forced.choices[0].text
    assert len(set(forced_lp.choices[0].logprobs.tokens)) == 1  # token 40, six times
    assert forced_lp.choices[0].logprobs.token_logprobs == pytest.approx([0.0] * 6, abs=1e-3)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("body,param", [
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty="high"), "frequency_penalty"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logit_bias={"5": 500}), "logit_bias"),
    (dict(logit_bias={"999999": 1}), "logit_bias"),
    (dict(logprobs=True, top_logprobs=30), "top_logprobs"),
    (dict(logprobs="yes"), "logprobs"),
])
async def test_bad_sampling_fields_are_400_naming_the_param(front, body, param):
    _, client = front
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=4,
                                             extra_body=body)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == param, exc.value.body
