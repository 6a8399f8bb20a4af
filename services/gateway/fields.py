"""Every request-body field the gateway accepts, in one table; any other field is refused.

A client that asks for something the gateway does not do must hear so (400 naming the field),
never get a 200 that silently ignored it. `Served(endpoints)`: the gateway reads the field on
those endpoints (services/gateway/openai_api.py translates it). `Unserved(default)`: not served
yet, accepted only at the value that asks for nothing (OpenAI's default, which SDKs and
frameworks send), any other value refused. `null` counts as absent, as in OpenAI's API.
To serve a field: change its line to `Served(...)` (or add one) and translate it in openai_api.py.
"""

from __future__ import annotations

from dataclasses import dataclass

CHAT, COMPLETION = "chat", "completion"  # /v1/chat/completions, /v1/completions
BOTH = frozenset({CHAT, COMPLETION})
ONLY_CHAT, ONLY_COMPLETION = frozenset({CHAT}), frozenset({COMPLETION})
_PATHS = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}


@dataclass(frozen=True)
class Served:
    endpoints: frozenset[str]


@dataclass(frozen=True)
class Unserved:
    default: object


FIELDS: dict[str, Served | Unserved] = {
    "model": Served(BOTH),
    "messages": Served(ONLY_CHAT),
    "prompt": Served(ONLY_COMPLETION),
    "max_tokens": Served(BOTH),
    "max_completion_tokens": Served(ONLY_CHAT),
    "temperature": Served(BOTH),
    "top_p": Served(BOTH),
    "top_k": Served(BOTH),  # vLLM's extension
    "seed": Served(BOTH),
    "stop": Served(BOTH),
    "stream": Served(BOTH),
    "stream_options": Served(BOTH),
    "response_format": Served(ONLY_CHAT),  # services/gateway/tool_grammar.py
    "tools": Served(ONLY_CHAT),
    "tool_choice": Served(ONLY_CHAT),
    "parallel_tool_calls": Served(ONLY_CHAT),
    "n": Served(BOTH),  # one prefill for all samples; with tools only 1
    "logprobs": Served(BOTH),  # chat: true/false; completions: the number of alternatives
    "top_logprobs": Served(ONLY_CHAT),  # services/gateway/openai_sampling.py
    "presence_penalty": Served(BOTH),
    "frequency_penalty": Served(BOTH),
    "repetition_penalty": Served(BOTH),  # vLLM's extension
    "logit_bias": Served(BOTH),
    "min_tokens": Served(BOTH),  # vLLM's extension
    "skip_special_tokens": Served(BOTH),  # vLLM's extension
    "echo": Unserved(False),  # completions
}


class UnsupportedField(ValueError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_fields(body: dict, endpoint: str) -> None:
    """Raises UnsupportedField for the first field of `body` the gateway does not serve."""
    for name, value in body.items():
        if value is None:
            continue
        entry = FIELDS.get(name)
        if entry is None:
            raise UnsupportedField(f"'{name}' is not supported by this gateway", name)
        if isinstance(entry, Served) and endpoint not in entry.endpoints:
            raise UnsupportedField(f"'{name}' is not supported on {_PATHS[endpoint]}", name)
        if isinstance(entry, Unserved) and not _same(value, entry.default):
            raise UnsupportedField(f"'{name}' is not supported by this gateway yet "
                                   f"(only {entry.default!r}, which asks for nothing)", name)


def _same(value, default) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and value == default
    return value == default
