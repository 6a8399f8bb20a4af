"""OpenAI HTTP API <-> specmesh protos: request parsing, response and error shapes.

Translation only: no policy, no state. Parsing raises `BadRequest`,
which the app turns into a 400 OpenAI-style error before anything is sent to the router.
Which body fields are served is one table (services/gateway/fields.py); structured outputs and
tools become the request's constraint (services/gateway/tool_grammar.py) and tool calls are parsed
back out of the text (services/gateway/tool_calls.py).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

import grpc

from services.common.errors import details_of
from services.gateway.fields import CHAT, COMPLETION, UnsupportedField, check_fields
from services.gateway.tool_calls import ToolCallDelta, ToolCallStream
from services.gateway.tool_grammar import (
    InvalidField,
    parse_tool_choice,
    parse_tools,
    response_format_constraint,
    tool_constraint,
    tool_protos,
)
from specmesh.proto.v1 import common_pb2, router_service_pb2, tools_pb2
from services.gateway.openai_sampling import chat_logprobs, completion_logprobs, surface_fields

MAX_STOP_STRINGS = 16

# gRPC status -> (HTTP status, OpenAI error type)
ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
           common_pb2.FINISH_REASON_LENGTH: "length"}


class BadRequest(ValueError):
    """The HTTP body is not a valid request; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Parsed:
    """A parsed OpenAI request: the router request plus how to answer."""

    request: router_service_pb2.GenerateRequest
    model: str
    stream: bool
    include_usage: bool
    chat: bool
    tool_calls: bool = False  # the output may hold tool calls (tools given, tool_choice not "none")


def parse_chat(body: dict) -> Parsed:
    _check_fields(body, CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content}", "messages")
    turns = [_message(m, i) for i, m in enumerate(messages)]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    parsed = _parsed(body, router_service_pb2.GenerateRequest(messages=turns), max_tokens, chat=True)
    try:
        _structured(body, parsed)
    except InvalidField as exc:
        raise BadRequest(str(exc), exc.field) from None
    if parsed.tool_calls and parsed.request.sampling.n > 1:  # tool-call parsing follows one choice
        raise BadRequest("'n' above 1 is not supported together with 'tools'", "n")
    return parsed


def parse_completion(body: dict) -> Parsed:
    _check_fields(body, COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string (one prompt per request)", "prompt")
    if body.get("echo"):
        raise BadRequest("'echo' is not supported", "echo")
    max_tokens = body.get("max_tokens", 16)  # OpenAI's default for completions
    return _parsed(body, router_service_pb2.GenerateRequest(prompt=prompt), max_tokens, chat=False)


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def grpc_error(exc: grpc.aio.AioRpcError) -> tuple[int, dict, dict]:
    """(HTTP status, OpenAI error body, extra headers) for a router error."""
    status, kind = ERRORS.get(exc.code(), (500, "api_error"))
    headers = {}
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-retry-pushback-ms" and str(value).isdigit():
            headers["Retry-After"] = str(max(1, math.ceil(int(value) / 1000)))
    body = error_body(exc.details() or exc.code().name, kind, code=exc.code().name.lower(),
                      param=_violated_param(exc))
    return status, body, headers


def _violated_param(exc: grpc.aio.AioRpcError) -> str | None:
    """The first invalid field the router named, as OpenAI names it ("sampling.top_p" -> "top_p")."""
    try:
        bad = details_of(exc).get("BadRequest")
    except Exception:  # no details, or details that do not match the status
        return None
    if bad is None or not bad.field_violations:
        return None
    return bad.field_violations[0].field.removeprefix("sampling.")


class Answer:
    """Builds the OpenAI response objects of one request from the router's chunks; with `n`
    samples, one choice per sample (chunk.index), in index order."""

    def __init__(self, parsed: Parsed) -> None:
        self.parsed = parsed
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts: dict[int, list[str]] = {}  # per choice index
        self.finish_reasons: dict[int, str] = {}
        self.usage: dict | None = None
        # Per choice index, when asked for: every token's log-probability, how many trailing
        # entries no streamed event carried yet, and completions' text_offset of the next one.
        self.logprobs: dict[int, list[common_pb2.TokenLogprob]] = {}
        self._unsent: dict[int, int] = {}
        self._offset: dict[int, int] = {}

        self.tools = ToolCallStream() if parsed.tool_calls else None  # one choice (n = 1) with tools
        self._content: list[str] = []  # the text outside tool calls

    def add(self, chunk: common_pb2.GenerateChunk) -> tuple[str, list[ToolCallDelta]]:
        """Takes one chunk; returns the content and tool-call deltas it decides."""
        index = chunk.index
        self.texts.setdefault(index, []).append(chunk.text)
        self.logprobs.setdefault(index, []).extend(chunk.logprobs)
        self._unsent[index] = self._unsent.get(index, 0) + len(chunk.logprobs)
        content, deltas = chunk.text, []
        if self.tools is not None:
            content, deltas = self.tools.feed(chunk.text)
            if chunk.finish_reason:
                content += self.tools.finish()
        self._content.append(content)
        if chunk.finish_reason:
            reason = _FINISH.get(chunk.finish_reason, "stop")
            if self.tools is not None and reason == "stop" and self.tools.complete_calls() \
                    and not self.tools.open_call:
                reason = "tool_calls"
            self.finish_reasons[index] = reason
        if chunk.HasField("usage"):
            u = chunk.usage
            self.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                          "total_tokens": u.prompt_tokens + u.completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}
        return content, deltas

    def full(self) -> dict:
        """The non-streaming response."""
        choices = []
        for index in sorted(self.texts):
            text, finish_reason = "".join(self.texts[index]), self.finish_reasons.get(index)
            logprobs = self._logprobs(self.logprobs.get(index, []))
            if self.parsed.chat:
                message = {"role": "assistant", "content": text}
                if self.tools is not None:
                    message = self._tool_message(text)
                choices.append({"index": index, "message": message, "logprobs": logprobs,
                                "finish_reason": finish_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
        return {**self._head(chunk=False), "choices": choices, "usage": self.usage}

    def events(self, content: str, deltas: list[ToolCallDelta], first: bool, finish_reason: str | None) -> list[dict]:
        """The streamed events for one chunk's content and tool-call deltas (chat with tools)."""
        out = [self.delta(content, first=first)] if content or first and not deltas else []
        for delta in deltas:
            event = self.delta("", first=first and not out)
            event["choices"][0]["delta"] = {**({"role": "assistant", "content": None} if first and not out else {}),
                                            "tool_calls": [delta.openai()]}
            out.append(event)
        if finish_reason is not None:
            out.append(self.delta("", finish_reason=finish_reason))
        return out

    def _tool_message(self, text: str) -> dict:
        calls = self.tools.complete_calls()
        content = "".join(self._content)
        if self.tools.open_call:  # cut off inside a call: nothing of the text is lost
            content = text
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message

    def delta(self, text: str, first: bool = False, finish_reason: str | None = None, index: int = 0) -> dict:
        """One streamed event (of choice `index`)."""
        if self.parsed.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            choice = {"index": index, "delta": delta, "logprobs": self._streamed_logprobs(index),
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": self._streamed_logprobs(index),
                      "finish_reason": finish_reason}
        event = {**self._head(chunk=True), "choices": [choice]}
        if self.parsed.include_usage:
            event["usage"] = None
        return event

    def usage_event(self) -> dict:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage}

    def _logprobs(self, entries: list, offset: int = 0) -> dict | None:
        """The choice's `logprobs` in the endpoint's shape (services/gateway/openai_sampling.py)."""
        if not self.parsed.request.sampling.logprobs:
            return None
        if self.parsed.chat:
            return chat_logprobs(entries)
        return completion_logprobs(entries, offset)[0]

    def _streamed_logprobs(self, index: int) -> dict | None:
        """Choice `index`'s log-probabilities not yet sent (text held back sends them later)."""
        entries = self.logprobs.get(index, [])
        entries = entries[len(entries) - self._unsent.get(index, 0):]
        self._unsent[index] = 0
        shaped = self._logprobs(entries, self._offset.get(index, 0))
        self._offset[index] = self._offset.get(index, 0) + sum(len(e.token) for e in entries)
        return shaped

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.parsed.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.parsed.model}


# ---- helpers ----------------------------------------------------------------
def _parsed(body: dict, request: router_service_pb2.GenerateRequest, max_tokens, chat: bool) -> Parsed:
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string (a pool name from GET /v1/models)", "model")
    request.model = model
    request.sampling.CopyFrom(_sampling(body, max_tokens))
    surface_fields(body, request.sampling, chat, BadRequest)
    n = body.get("n")  # samples of the prompt; the router refuses more than its limit
    request.sampling.n = 1 if n is None else _number(n, "n", int, 1)
    stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return Parsed(request, model, stream, bool(options.get("include_usage")), chat)


def _sampling(body: dict, max_tokens) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams(
        max_tokens=_number(max_tokens, "max_tokens", int, 1),
        temperature=_number(body.get("temperature", 1.0), "temperature", float, 0.0),
        top_p=_number(body.get("top_p", 1.0), "top_p", float, 0.0),
        top_k=_number(body.get("top_k", 0), "top_k", int, 0))
    if sampling.top_p >= 1.0:
        sampling.top_p = 0.0  # 1.0 = off; the router's 0 means off
    seed = body.get("seed")
    if seed is not None:
        sampling.seed, sampling.has_seed = _number(seed, "seed", int, 0), True
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    sampling.stop.extend(stops)
    if "skip_special_tokens" in body:  # vLLM's extra field; unset = skip
        sampling.skip_special_tokens = _bool(body, "skip_special_tokens")
    return sampling


def _number(value, name: str, kind: type, minimum):
    if value is None:
        raise BadRequest(f"'{name}' must be a number", name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a finite number", name)
    if kind is int and value != int(value):
        raise BadRequest(f"'{name}' must be an integer", name)
    if value < minimum:
        raise BadRequest(f"'{name}' must be >= {minimum}, got {value}", name)
    return kind(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false", name)
    return value


def _check_fields(body: dict, endpoint: str) -> None:
    try:
        check_fields(body, endpoint)
    except UnsupportedField as exc:
        raise BadRequest(str(exc), exc.field) from None


def _structured(body: dict, parsed: Parsed) -> None:
    """response_format, tools, tool_choice, parallel_tool_calls -> constraint and tools."""
    constraint = response_format_constraint(body.get("response_format"))
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if tools and choice != "none":
        if constraint is not None:
            raise BadRequest("'response_format' together with 'tools' is not supported; use one",
                             "response_format")
        constraint = tool_constraint(tools, choice, parallel is not False)
        parsed.request.tools.extend(tool_protos(tools))
        parsed.tool_calls = True
    if constraint is not None:
        parsed.request.sampling.constraint.CopyFrom(constraint)


# Per role, the message keys the gateway reads; any other key is refused.
_MESSAGE_KEYS = {"system": {"role", "content"}, "developer": {"role", "content"}, "user": {"role", "content"},
                 "assistant": {"role", "content", "tool_calls", "refusal"},
                 "tool": {"role", "content", "tool_call_id", "name"}}


def _message(message, index: int) -> common_pb2.ChatMessage:
    role = _role(message, index)
    keys = _MESSAGE_KEYS.get(message["role"], {"role", "content"})
    for key, value in message.items():
        if key not in keys and value is not None:
            raise BadRequest(f"messages[{index}].{key} is not supported (role {message['role']!r})", "messages")
    if message.get("refusal") is not None:
        raise BadRequest(f"messages[{index}].refusal is not supported", "messages")
    calls = [_tool_call(c, index, j) for j, c in enumerate(message.get("tool_calls") or ())]
    content = "" if calls and message.get("content") is None else _content(message, index)
    turn = common_pb2.ChatMessage(role=role, content=content, tool_calls=calls)
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str) or not message["tool_call_id"]:
            raise BadRequest(f"messages[{index}] (role 'tool') needs a 'tool_call_id'", "messages")
        turn.tool_call_id = message["tool_call_id"]
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise BadRequest(f"messages[{index}].name must be a string", "messages")
            turn.name = message["name"]
    return turn


def _tool_call(call, index: int, j: int) -> tools_pb2.ToolCall:
    where = f"messages[{index}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function" \
            or not isinstance(call.get("id"), str) or not isinstance(function.get("name"), str) \
            or not isinstance(function.get("arguments"), str) or set(call) - {"id", "type", "function"} \
            or set(function) - {"name", "arguments"}:
        raise BadRequest(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": "
                         f"{{\"name\", \"arguments\" (JSON text)}}}}", "messages")
    try:
        json.loads(function["arguments"])
    except ValueError:
        raise BadRequest(f"{where}.function.arguments is not JSON", "messages") from None
    return tools_pb2.ToolCall(id=call["id"], name=function["name"], arguments_json=function["arguments"])


def _role(message, index: int) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"messages[{index}] needs a string 'role'", "messages")
    role = message["role"]
    return "system" if role == "developer" else role  # OpenAI's newer name for the system turn


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{index}].content must be a string or a list of text parts", "messages")
