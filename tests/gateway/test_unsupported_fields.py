"""Every body field the gateway does not serve is refused with 400 naming it, never ignored
(services/gateway/fields.py), through the official `openai` client against a tiny mesh; fields at
their do-nothing values change nothing. Chat with tools and tool history
(tool_choice "none": no constraint, tools not shown) answers on a model without a tool format."""

from __future__ import annotations

import openai
import pytest

from services.gateway.fields import FIELDS, Unserved

pytestmark = pytest.mark.asyncio(loop_scope="module")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("kwargs, param", [
    ({"user": "someone"}, "user"),
    ({"metadata": {"a": "b"}}, "metadata"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"extra_body": {"prediction": {"type": "content", "content": "x"}}}, "prediction"),
    ({"extra_body": {"modalities": ["text", "audio"]}}, "modalities"),
    ({"n": 2, "tools": [WEATHER]}, "n"),  # tool-call parsing follows one choice
])
async def test_unsupported_fields_get_400_naming_them(client, kwargs, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=4, stream=stream,
                                                 **kwargs)
        assert exc.value.status_code == 400
        assert exc.value.body["param"] == param and f"'{param}'" in exc.value.body["message"]


async def test_completions_refuse_chat_only_fields(client):
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model="default", prompt="Hi", max_tokens=4,
                                        extra_body={"response_format": {"type": "json_object"}})
    assert exc.value.body["param"] == "response_format"
    assert "not supported on /v1/completions" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model="default", prompt="Hi", max_tokens=4, suffix="!")
    assert exc.value.body["param"] == "suffix"


async def test_do_nothing_defaults_pass(client):
    plain = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=6, temperature=0)
    # Served fields at the values that ask for nothing change nothing.
    defaults = {"n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
                "logit_bias": {}, "min_tokens": 0, "skip_special_tokens": True,
                **{name: entry.default for name, entry in FIELDS.items()
                   if isinstance(entry, Unserved) and name != "echo"}}
    same = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=6, temperature=0,
                                                extra_body=defaults)
    assert same.choices[0].message.content == plain.choices[0].message.content


async def test_tools_with_tool_choice_none_and_tool_history(client):
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    answer = await client.chat.completions.create(model="default", messages=history, max_tokens=6, temperature=0,
                                                  tools=[WEATHER], tool_choice="none")
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str) and answer.usage.completion_tokens == 6
