"""Tools in chat prompts (services/target/server/chat.py) and the chat template setting
(services/common/models/chat_templates.py): the generic format where the template has no tool
format (Gemma 3's), the template's own where it has one; `--chat-template FILE|NAME`."""

from __future__ import annotations

import json

import pytest

from services.common.models.chat_templates import GEMMA3_CHAT_TEMPLATE, apply_chat_template_setting
from services.common.models.tiny import build_tiny_tokenizer
from services.target.server.chat import (
    GENERIC_TOOLS_HEADER,
    chat_prompt_ids,
    renders_tools,
)
from specmesh.proto.v1 import common_pb2, tools_pb2

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = tools_pb2.Tool(name="get_weather", description="Weather of a city", parameters_json=json.dumps(PARAMS))
CONVERSATION = [
    common_pb2.ChatMessage(role="user", content="Weather in Paris?"),
    common_pb2.ChatMessage(role="assistant", tool_calls=[
        tools_pb2.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Paris"}')]),
    common_pb2.ChatMessage(role="tool", tool_call_id="call_1", name="get_weather", content="sunny"),
    common_pb2.ChatMessage(role="user", content="And tomorrow?"),
]
# A minimal Hermes-style template with a tool format (as Qwen's and Hermes' templates render it).
HERMES_TEMPLATE = """{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}
{% endif %}{%- for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_generic_format_where_the_template_has_no_tool_format():
    tokenizer = build_tiny_tokenizer(chat=True)
    assert not renders_tools(tokenizer.chat_template)
    listing = GENERIC_TOOLS_HEADER + json.dumps(
        {"name": "get_weather", "description": "Weather of a city", "parameters": PARAMS})
    expected = [
        {"role": "system", "content": listing},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                         "\n</tool_call>"},
        {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\nAnd tomorrow?"},
    ]
    want = tokenizer.apply_chat_template(expected, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat_prompt_ids(tokenizer, CONVERSATION, [TOOL]) == list(want["input_ids"])
    text = tokenizer.decode(chat_prompt_ids(tokenizer, CONVERSATION, [TOOL]))
    assert text.startswith("<bos><start_of_turn>user\nTo call a function")  # Gemma: system joins the user turn
    # Without tools and tool turns nothing changes.
    plain = [{"role": "user", "content": "hi"}]
    assert chat_prompt_ids(tokenizer, plain) == list(tokenizer.apply_chat_template(
        plain, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def test_the_templates_own_tool_format_where_it_has_one():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    assert renders_tools(HERMES_TEMPLATE)
    text = tokenizer.decode(chat_prompt_ids(tokenizer, CONVERSATION, [TOOL]))
    assert text == ("<|system|>Tools: get_weather<|user|>Weather in Paris?"
                    '<|assistant|><tool_call>get_weather {"city": "Paris"}</tool_call>'
                    "<|tool|>sunny<|user|>And tomorrow?<|assistant|>")


def test_bad_tools_are_refused():
    from services.target.server.chat import ChatTemplateError
    tokenizer = build_tiny_tokenizer(chat=True)
    with pytest.raises(ChatTemplateError, match="parameters_json is not JSON"):
        chat_prompt_ids(tokenizer, CONVERSATION[:1], [tools_pb2.Tool(name="t", parameters_json="{")])
    bad_call = common_pb2.ChatMessage(role="assistant", tool_calls=[tools_pb2.ToolCall(id="c", name="t",
                                                                                         arguments_json="[")])
    with pytest.raises(ChatTemplateError, match="arguments_json is not JSON"):
        chat_prompt_ids(tokenizer, [CONVERSATION[0], bad_call], [TOOL])


def test_chat_template_setting(tmp_path):
    gemma_vocab = build_tiny_tokenizer(chat=True)
    gemma_vocab.chat_template = None  # Gemma's turn tokens, no template: the default model's case
    assert apply_chat_template_setting(gemma_vocab).startswith("gemma3")
    assert gemma_vocab.chat_template == GEMMA3_CHAT_TEMPLATE
    plain = build_tiny_tokenizer()  # no turn tokens: stays without a template
    assert apply_chat_template_setting(plain).startswith("none") and not plain.chat_template
    assert apply_chat_template_setting(plain, "gemma3") == "gemma3" and plain.chat_template == GEMMA3_CHAT_TEMPLATE
    apply_chat_template_setting(plain, "none")
    assert plain.chat_template is None
    jinja = tmp_path / "t.jinja"
    jinja.write_text(HERMES_TEMPLATE)
    apply_chat_template_setting(plain, str(jinja))
    assert plain.chat_template == HERMES_TEMPLATE
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": GEMMA3_CHAT_TEMPLATE}))
    apply_chat_template_setting(plain, str(config))
    assert plain.chat_template == GEMMA3_CHAT_TEMPLATE
    for bad, words in (("no-such-template", "neither a file nor one of"), (str(tmp_path / "x.json"), "neither")):
        with pytest.raises(ValueError, match=words):
            apply_chat_template_setting(plain, bad)
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ValueError, match="no \"chat_template\""):
        apply_chat_template_setting(plain, str(tmp_path / "empty.json"))
