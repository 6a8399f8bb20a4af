"""Chat requests: messages (and tools) rendered with the model's chat template into prompt ids.

Tools. Where the model's template has a tool format (it renders `tools=` at all; Qwen, Llama 3.1,
Mistral and Hermes templates do), tools, assistant tool calls and tool results go to the template
as transformers documents them (`tools=[{"type": "function", "function": {...}}]`, assistant
`tool_calls`, role "tool" turns). Elsewhere (Gemma 3's template has none) specmesh renders them
in one generic format, Hermes style, the format the gateway's tool-call grammar constrains the
output to (services/gateway/tool_grammar.py):

- the tool list goes into the system turn: GENERIC_TOOLS_HEADER, then one JSON line per tool
  ({"name", "description" when there is one, "parameters"});
- an assistant turn's calls are appended to its content as
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks;
- a tool result becomes a user turn `<tool_response>\\n...\\n</tool_response>`, merged with an
  adjacent user turn (templates such as Gemma's require user and assistant turns to alternate).
"""

from __future__ import annotations

import json
from functools import lru_cache

MAX_MESSAGES = 1024  # per request; the router's size limits apply to the contents
MAX_TOOLS = 128
TOOL_CALL_BEGIN, TOOL_CALL_END = "<tool_call>\n", "\n</tool_call>"
TOOL_RESPONSE_BEGIN, TOOL_RESPONSE_END = "<tool_response>\n", "\n</tool_response>"
GENERIC_TOOLS_HEADER = ('To call a function, answer with <tool_call>\n{"name": <name>, "arguments": <JSON object>}'
                        "\n</tool_call> (one block per call). Results come back in <tool_response>. "
                        "The functions:\n")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refuses them)."""


def chat_prompt_ids(tokenizer, messages, tools=()) -> list[int]:
    """Prompt ids of `messages` (ChatMessage protos or role/content dicts) and `tools` (Tool
    protos), generation prompt added: what `tokenizer.apply_chat_template(...,
    add_generation_prompt=True)` gives, with tools rendered as the module docstring says."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
    if len(messages) > MAX_MESSAGES:
        raise ChatTemplateError(f"{len(messages)} messages is above the limit {MAX_MESSAGES}")
    if len(tools) > MAX_TOOLS:
        raise ChatTemplateError(f"{len(tools)} tools is above the limit {MAX_TOOLS}")
    turns = [_as_dict(m) for m in messages]
    for turn in turns:
        if not turn["role"]:
            raise ChatTemplateError("every message needs a role (system, user, assistant or tool)")
    tool_dicts = [_tool_dict(t) for t in tools]
    uses_tools = bool(tool_dicts) or any(t.get("tool_calls") or t["role"] == "tool" for t in turns)
    extra = {}
    if uses_tools and renders_tools(tokenizer.chat_template):
        extra = {"tools": tool_dicts} if tool_dicts else {}
    elif uses_tools:
        turns = generic_tool_turns(turns, tool_dicts)
    else:
        turns = [{"role": t["role"], "content": t["content"]} for t in turns]
    try:
        encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                return_dict=True, **extra)
    except Exception as exc:  # jinja's TemplateError, raise_exception(...) in the template
        raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") from None
    return list(encoded["input_ids"])


@lru_cache(maxsize=32)
def renders_tools(chat_template: str) -> bool:
    """Whether a chat template has a tool format: it renders a probe tool at all."""
    from transformers.utils.chat_template_utils import render_jinja_template

    probe = [{"type": "function", "function": {"name": "specmesh_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}]
    try:
        rendered, _ = render_jinja_template([[{"role": "user", "content": "hi"}]], tools=probe,
                                            chat_template=chat_template, add_generation_prompt=True)
    except Exception:
        return False
    return "specmesh_probe_tool" in rendered[0]


def generic_tool_turns(turns: list[dict], tools: list[dict]) -> list[dict]:
    """Plain role/content turns carrying tools, calls and results in the generic format."""
    out: list[dict] = []
    merge_next = False  # the previous turn came from a tool result: a user turn joins it
    for turn in turns:
        role, content = turn["role"], turn["content"]
        if role == "assistant" and turn.get("tool_calls"):
            blocks = [TOOL_CALL_BEGIN + json.dumps({"name": c["function"]["name"],
                                                    "arguments": c["function"]["arguments"]}) + TOOL_CALL_END
                      for c in turn["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        from_tool = role == "tool"
        if from_tool:
            role, content = "user", TOOL_RESPONSE_BEGIN + content + TOOL_RESPONSE_END
        if out and role == "user" and out[-1]["role"] == "user" and (from_tool or merge_next):
            out[-1]["content"] += "\n" + content
        else:
            out.append({"role": role, "content": content})
        merge_next = from_tool or (merge_next and role == "user")
    if tools:
        listing = GENERIC_TOOLS_HEADER + "\n".join(json.dumps(_listed(t["function"])) for t in tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _listed(function: dict) -> dict:
    return {k: function[k] for k in ("name", "description", "parameters") if function.get(k) or k != "description"}


def _tool_dict(tool) -> dict:
    try:
        parameters = json.loads(tool.parameters_json) if tool.parameters_json else {"type": "object"}
    except ValueError as exc:
        raise ChatTemplateError(f"tool {tool.name!r}: parameters_json is not JSON: {exc}") from None
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": parameters}}


def _as_dict(message) -> dict:
    if isinstance(message, dict):
        return {"role": message.get("role", ""), "content": message.get("content", ""),
                **{k: message[k] for k in ("tool_calls", "tool_call_id", "name") if message.get(k)}}
    turn = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function",
                               "function": {"name": c.name, "arguments": _arguments(c)}}
                              for c in message.tool_calls]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.name:
        turn["name"] = message.name
    return turn


def _arguments(call):
    """A call's arguments as the value templates expect (transformers documents a dict)."""
    try:
        return json.loads(call.arguments_json) if call.arguments_json else {}
    except ValueError as exc:
        raise ChatTemplateError(f"tool call {call.id!r}: arguments_json is not JSON: {exc}") from None
