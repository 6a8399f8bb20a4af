"""Structured outputs and tool calls through gateway -> router -> target, with the official `openai`
client on a tiny mesh: response_format json_schema and json_object, tools with each tool_choice,
tool-call deltas streamed, finish_reason "tool_calls". The tiny model's choices are arbitrary; the
grammar is what makes every answer parse and validate (jsonschema)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from services.common.models.tiny import build_tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="module")
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# Finite languages (enums, booleans), so that any model finishes them within max_tokens.
WEATHER_ARGS = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                 "tomorrow": {"type": "boolean"}},
                "required": ["unit", "tomorrow"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-chat"), arch="llama", seed=3, chat=True,
                            max_position_embeddings=2048)  # room for the tool listing (byte-level tokens)


def _valid_calls(calls, names=None):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert list(arguments) == list(SCHEMAS[call.function.name]["properties"])  # in the declared order


async def test_response_format_json_schema_and_json_object(client):
    for temperature, seed in ((0, None), (1.0, 7)):
        answer = await client.chat.completions.create(
            model="default", messages=QUESTION, max_tokens=48, temperature=temperature, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER,
                                                                     "strict": True}})
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), ANSWER)
    answer = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=160, temperature=0,
                                                  response_format={"type": "json_object"})
    if answer.choices[0].finish_reason == "stop":  # any object: the tiny model may go on past 64 tokens
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    else:
        assert answer.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("tool_choice, names", [
    ("required", None),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
async def test_tool_calls_for_each_forcing_tool_choice(client, tool_choice, names):
    for temperature, seed in ((0, None), (0.8, 3)):
        answer = await client.chat.completions.create(
            model="default", messages=QUESTION, max_tokens=160, temperature=temperature, seed=seed, tools=TOOLS,
            tool_choice=tool_choice, parallel_tool_calls=False)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        _valid_calls(choice.message.tool_calls, names)
        assert len(choice.message.tool_calls) == 1 and not choice.message.content


async def test_tool_choice_auto_answers_text_or_valid_calls(client):
    answer = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=24, temperature=0,
                                                  tools=TOOLS)  # tool_choice defaults to auto
    choice = answer.choices[0]
    if choice.message.tool_calls:
        _valid_calls(choice.message.tool_calls)
        assert choice.finish_reason in ("tool_calls", "length")
    else:
        assert choice.finish_reason in ("stop", "length") and "<tool_call>" not in (choice.message.content or "")


async def test_streamed_tool_call_deltas_equal_the_full_answer(client):
    kwargs = dict(model="default", messages=QUESTION, max_tokens=160, temperature=0, tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=False)
    full = (await client.chat.completions.create(**kwargs)).choices[0].message.tool_calls[0]
    events = [e async for e in await client.chat.completions.create(stream=True, **kwargs)]
    deltas = [d for e in events if e.choices for d in (e.choices[0].delta.tool_calls or ())]
    assert deltas[0].id and deltas[0].function.name == full.function.name and deltas[0].index == 0
    assert all(d.id is None and d.index == 0 for d in deltas[1:])
    assert len(deltas) > 2  # the arguments arrive in pieces as they are generated
    assert "".join(d.function.arguments or "" for d in deltas) == full.function.arguments
    assert events[0].choices[0].delta.role == "assistant"
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"
    # The SDK's own accumulator agrees.
    async with client.chat.completions.stream(**kwargs) as stream:
        final = await stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == full.function.arguments


async def test_a_tool_result_round_trip(client):
    first = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=160, temperature=0,
                                                 tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    second = await client.chat.completions.create(
        model="default", messages=history, max_tokens=48, temperature=0, tools=TOOLS, tool_choice="none",
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER}})
    assert second.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(second.choices[0].message.content), ANSWER)


async def test_bad_schema_is_400_and_the_mesh_goes_on(client):
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}}})
    assert exc.value.status_code == 400 and "schema" in exc.value.body["message"]
    answer = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason == "length"
