"""OpenAI `response_format`, `tools` and `tool_choice` -> the request's Constraint (and Tool protos).

Structured outputs travel as `SamplingParams.constraint`, compiled and enforced by the target
(xgrammar); the gateway only translates, and checks what it can before the router is called.

- `response_format` {"type": "json_object"} -> Constraint.json_object; {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}} -> Constraint.json_schema (the schema's JSON text;
  the output is always held to it, whatever `strict` says); {"type": "text"} -> none.
- `tools` with `tool_choice` -> Constraint.grammar: one tool-call format for every model, Hermes
  style (Qwen 3's, and what specmesh's generic tool prompt asks for, services/target/server/chat.py):

      <tool_call>\\n{"name": "<function>", "arguments": <JSON under its parameters schema>}\\n</tool_call>

  built with xgrammar's structural tags for that format (xgrammar.get_model_structural_tag, model
  "qwen_3", no reasoning block) and sent as the grammar's EBNF text:
  * "auto" (the default): free text, in which every `<tool_call>` must open a valid call of one
    of the tools (text before, between or after calls stays content);
  * "required": one call or more (only whitespace between them), no free text;
  * {"type": "function", "function": {"name": N}}: exactly one call of N;
  * "none": no constraint, and the tools are not shown to the model.
  `parallel_tool_calls: false` allows one call at most. Runs of whitespace inside the JSON are
  at most MAX_WHITESPACE long (one space after `:` and `,`; a model cannot pad forever), and
  properties come in the order the schema declares them.
The gateway parses the output back into `tool_calls` (services/gateway/tool_calls.py).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from services.common.constraints import MAX_CONSTRAINT_BYTES
from specmesh.proto.v1 import common_pb2, tools_pb2

MAX_TOOLS = 128  # services/target/server/chat.py MAX_TOOLS
MAX_WHITESPACE = 1
TOOL_FORMAT = "qwen_3"  # xgrammar's builtin structural tag of the Hermes <tool_call> format
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_SCHEMA_KEYS = {"name", "schema", "strict"}


class InvalidField(ValueError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def response_format_constraint(value) -> common_pb2.Constraint | None:
    """The Constraint for an OpenAI `response_format` (None for text or absent)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidField("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                           "response_format")
    kind = value["type"]
    extra = set(value) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
    if extra:
        raise InvalidField(f"response_format.{sorted(extra)[0]} is not supported", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.Constraint(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not _NAME.match(spec["name"]):
        raise InvalidField("response_format.json_schema needs a 'name' of 1-64 letters, digits, _ or -",
                           "response_format.json_schema.name")
    extra = set(spec) - _SCHEMA_KEYS
    if extra:
        raise InvalidField(f"response_format.json_schema.{sorted(extra)[0]} is not supported",
                           "response_format.json_schema")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidField("response_format.json_schema.strict must be true or false",
                           "response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, (dict, bool)):
        raise InvalidField("response_format.json_schema.schema must be a JSON schema (an object)",
                           "response_format.json_schema.schema")
    text = json.dumps(schema)  # key order kept: properties are generated in the declared order
    _check_schema(text, "response_format.json_schema.schema")
    return common_pb2.Constraint(json_schema=text)


def parse_tools(value) -> list[dict]:
    """OpenAI `tools` -> [{"name", "description", "parameters"}], checked ([] when absent)."""
    if value is None:
        return []
    if not isinstance(value, list) or not value or len(value) > MAX_TOOLS:
        raise InvalidField(f"'tools' must be a list of 1 to {MAX_TOOLS} tools", "tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"} \
                or not isinstance(tool.get("function"), dict):
            raise InvalidField(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        function = tool["function"]
        extra = set(function) - _FUNCTION_KEYS
        if extra:
            raise InvalidField(f"{where}.function.{sorted(extra)[0]} is not supported", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidField(f"{where}.function.name must be 1-64 letters, digits, _ or -", f"{where}.function.name")
        if name in names:
            raise InvalidField(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        description = function.get("description") or ""
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(description, str):
            raise InvalidField(f"{where}.function.description must be a string", f"{where}.function.description")
        if not isinstance(parameters, dict):
            raise InvalidField(f"{where}.function.parameters must be a JSON schema object",
                               f"{where}.function.parameters")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise InvalidField(f"{where}.function.strict must be true or false", f"{where}.function.strict")
        _check_schema(json.dumps(parameters), f"{where}.function.parameters")
        tools.append({"name": name, "description": description, "parameters": parameters})
    return tools


def parse_tool_choice(value, tools: list[dict]) -> str | None:
    """"auto", "none", "required" or a function name; None without tools."""
    if not tools:
        if value is not None:
            raise InvalidField("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and set(value) == {"type", "function"} and set(value["function"]) == {"name"}:
        name = value["function"]["name"]
        if name not in {t["name"] for t in tools}:
            raise InvalidField(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
        return name
    raise InvalidField("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def tool_constraint(tools: list[dict], choice: str, parallel: bool) -> common_pb2.Constraint:
    """The grammar for `choice` over `tools` ("none" is the caller's to skip)."""
    text = json.dumps(tools)  # key order kept: arguments follow the declared property order
    grammar = _tool_grammar(text, choice, parallel)
    if len(grammar.encode()) > MAX_CONSTRAINT_BYTES:
        raise InvalidField(f"the tools make a grammar of {len(grammar.encode())} bytes, above the limit of "
                           f"{MAX_CONSTRAINT_BYTES}: send fewer or smaller tools", "tools")
    return common_pb2.Constraint(grammar=grammar)


def tool_protos(tools: list[dict]) -> list[tools_pb2.Tool]:
    return [tools_pb2.Tool(name=t["name"], description=t["description"],
                           parameters_json=json.dumps(t["parameters"])) for t in tools]


@lru_cache(maxsize=256)
def _tool_grammar(tools_json: str, choice: str, parallel: bool) -> str:
    import xgrammar
    from xgrammar.builtin_structural_tag import get_model_structural_tag

    tools = [{"type": "function", "function": t} for t in json.loads(tools_json)]
    tool_choice = choice if choice in ("auto", "required") else {"type": "function", "function": {"name": choice}}
    try:
        tag = get_model_structural_tag(TOOL_FORMAT, tools=tools, tool_choice=tool_choice, reasoning="disabled",
                                       exclude_special_tokens=False, max_whitespace_cnt=MAX_WHITESPACE,
                                       parallel_tool_calls=parallel)
        return str(xgrammar.Grammar.from_structural_tag(tag))
    except Exception as exc:  # xgrammar's schema and structural-tag errors
        raise InvalidField(f"the tools' parameter schemas do not make a grammar: {exc}", "tools") from None


@lru_cache(maxsize=256)
def _check_schema(schema_json: str, field: str) -> None:
    """A schema xgrammar cannot turn into a grammar is the caller's error (400), here already."""
    import xgrammar
    try:
        xgrammar.Grammar.from_json_schema(schema_json, max_whitespace_cnt=MAX_WHITESPACE)
    except Exception as exc:
        raise InvalidField(f"{field} is not a usable JSON schema: {exc}", field) from None
