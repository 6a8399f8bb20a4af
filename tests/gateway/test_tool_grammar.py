"""What the gateway sends for response_format / tools / tool_choice (services/gateway/tool_grammar.py),
checked with xgrammar's own matcher, and how tool calls come back out of the text
(services/gateway/tool_calls.py), streamed in any split."""

from __future__ import annotations

import json
import random

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from services.gateway.openai_api import BadRequest, parse_chat
from services.gateway.tool_calls import ToolCallStream, parse_tool_calls
from services.target.server import chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
BAD_ARGS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3, "days": 3}}\n</tool_call>'
UNKNOWN = '<tool_call>\n{"name": "get_news", "arguments": {}}\n</tool_call>'


def _grammar(**body) -> Grammar:
    parsed = parse_chat({"model": "default", "messages": USER, "max_tokens": 64, "tools": [WEATHER, TIME], **body})
    assert parsed.tool_calls and [t.name for t in parsed.request.tools] == ["get_weather", "get_time"]
    return Grammar.from_ebnf(parsed.request.sampling.constraint.grammar)


@pytest.mark.parametrize("body, accepted, refused", [
    ({}, ["Paris is sunny.", CALL, "Let me look. " + CALL, CALL + "\n" + TIME_CALL],
     [BAD_ARGS, UNKNOWN, "x " + BAD_ARGS]),
    ({"tool_choice": "auto", "parallel_tool_calls": False}, ["Sunny.", CALL], [CALL + "\n" + TIME_CALL]),
    ({"tool_choice": "required"}, [CALL, TIME_CALL, CALL + "\n" + TIME_CALL],
     ["Paris is sunny.", "Sure. " + CALL, BAD_ARGS, UNKNOWN, ""]),
    ({"tool_choice": "required", "parallel_tool_calls": False}, [CALL], [CALL + "\n" + TIME_CALL]),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, [TIME_CALL],
     [CALL, "It is noon.", TIME_CALL + "\n" + TIME_CALL]),
])
def test_tool_choice_grammars(body, accepted, refused):
    grammar = _grammar(**body)
    for text in accepted:
        assert accepts(grammar, text), text
    for text in refused:
        assert not accepts(grammar, text), text


def test_tool_choice_none_and_response_format():
    parsed = parse_chat({"model": "m", "max_tokens": 8, "messages": USER, "tools": [WEATHER], "tool_choice": "none"})
    assert not parsed.tool_calls and not parsed.request.tools
    assert not parsed.request.sampling.HasField("constraint")
    parsed = parse_chat({"model": "m", "max_tokens": 8, "messages": USER, "response_format": {"type": "json_object"}})
    assert parsed.request.sampling.constraint.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    parsed = parse_chat({"model": "m", "max_tokens": 8, "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}})
    assert json.loads(parsed.request.sampling.constraint.json_schema) == schema
    parsed = parse_chat({"model": "m", "max_tokens": 8, "messages": USER, "response_format": {"type": "text"}})
    assert not parsed.request.sampling.HasField("constraint")


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
    ({"tools": []}, "tools", "list of 1 to"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters", "not a usable JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]}, "tools[0].function",
     "not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "together"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "not a usable JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "description": "d"}}},
     "response_format.json_schema", "description is not supported"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages", "messages[0].name"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages", "needs a 'tool_call_id'"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{"}}]}]},
     "messages", "arguments is not JSON"),
])
def test_bad_structured_requests_name_the_field(body, param, words):
    with pytest.raises(BadRequest) as exc:
        parse_chat({"model": "m", "max_tokens": 8, "messages": USER, **body})
    assert exc.value.param == param and words in str(exc.value)


def test_tools_too_large_for_a_grammar_are_400():
    many = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object", "properties": {
        f"field_{i}_{j}": {"enum": [f"value_{i}_{j}_{k}" for k in range(4)]} for j in range(10)}}}} for i in range(100)]
    with pytest.raises(BadRequest) as exc:
        parse_chat({"model": "m", "max_tokens": 8, "messages": USER, "tools": many})
    assert exc.value.param == "tools" and "above the limit" in str(exc.value)


def test_history_with_tool_calls_becomes_protos():
    parsed = parse_chat({"model": "m", "max_tokens": 8, "tools": [WEATHER], "messages": USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assistant, tool = parsed.request.messages[1:]
    assert (assistant.content, assistant.tool_calls[0].name, assistant.tool_calls[0].id) == ("", "get_weather", "call_1")
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "sunny")


def test_tool_calls_parse_and_stream_in_any_split():
    text = 'Let me check. ' + CALL + "\n" + TIME_CALL + "\n"
    content, calls, cut = parse_tool_calls(text)
    assert (content, cut) == ("Let me check. ", False)
    assert [(c.name, "".join(c.arguments)) for c in calls] == [("get_weather", '{"city": "Paris", "days": 3}'),
                                                                ("get_time", "{}")]
    rng = random.Random(0)
    for _ in range(50):
        stream, pieces, deltas, i = ToolCallStream(), [], [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            content, new = stream.feed(text[i:i + n])
            pieces.append(content)
            deltas.extend(new)
            i += n
        pieces.append(stream.finish())
        assert "".join(pieces) == "Let me check. "
        starts = [d for d in deltas if d.id is not None]
        assert [(d.index, d.name) for d in starts] == [(0, "get_weather"), (1, "get_time")]
        assert "".join(d.arguments for d in deltas if d.index == 0) == '{"city": "Paris", "days": 3}'
        assert deltas[0].id is not None  # the name comes before any argument text
    content, calls, cut = parse_tool_calls(CALL[:-20])  # cut off inside the call
    assert cut and calls == []
    assert parse_tool_calls("a < b, <tool") == ("a < b, <tool", [], False)


def test_the_generic_prompt_asks_for_the_format_the_grammar_enforces():
    assert chat.TOOL_CALL_BEGIN.strip() == "<tool_call>" and chat.TOOL_CALL_END.strip() == "</tool_call>"
    example = chat.TOOL_CALL_BEGIN + json.dumps({"name": "get_time", "arguments": {}}) + chat.TOOL_CALL_END
    assert accepts(_grammar(tool_choice="required"), example)  # what generic_tool_turns writes for a call
