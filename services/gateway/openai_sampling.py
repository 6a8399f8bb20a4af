"""OpenAI's penalty, bias and log-probability fields <-> SamplingParams, and the two
`logprobs` response shapes (chat's `content` list, completions' parallel lists).

Request fields (types checked here; ranges by the router, whose INVALID_ARGUMENT names the
field and becomes a 400):
  presence_penalty, frequency_penalty   numbers (OpenAI)
  repetition_penalty, min_tokens        vLLM's extensions
  logit_bias                            {"token id": bias}
  chat:        logprobs (bool), top_logprobs (int)
  completions: logprobs (int k: the chosen token and the k most likely alternatives)
"""

from __future__ import annotations

import math

from specmesh.proto.v1 import common_pb2

MIN_LOGPROB = -9999.0  # what JSON gets for -inf (a token the sampling filters dropped), as vLLM


def surface_fields(body: dict, sampling: common_pb2.SamplingParams, chat: bool, bad_request) -> None:
    """Copies the fields of the module docstring from `body` into `sampling`; raises
    `bad_request(message, param)` for a wrong type."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = body.get(name)
        if value is not None:
            setattr(sampling, name, _finite(value, name, bad_request))
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        sampling.min_tokens = _integer(min_tokens, "min_tokens", bad_request)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad_request("'logit_bias' must be an object of token id -> bias", "logit_bias")
        for key, value in bias.items():
            if not (isinstance(key, str) and key.strip().lstrip("-").isdigit()):
                raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
            token = int(key)
            if not -2**31 <= token < 2**31:
                raise bad_request(f"'logit_bias' token id {token} is out of range", "logit_bias")
            sampling.logit_bias[token] = _finite(value, "logit_bias", bad_request)
    logprobs = body.get("logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise bad_request("'logprobs' must be true or false", "logprobs")
        sampling.logprobs = bool(logprobs)
        top = body.get("top_logprobs")
        if top is not None:
            sampling.top_logprobs = _integer(top, "top_logprobs", bad_request)
    elif logprobs is not None:
        sampling.logprobs = True
        sampling.top_logprobs = _integer(logprobs, "logprobs", bad_request)


def chat_logprobs(entries: list[common_pb2.TokenLogprob]) -> dict:
    """A chat choice's `logprobs` object for these tokens."""
    return {"content": [{**_token(e), "top_logprobs": [_token(t) for t in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[common_pb2.TokenLogprob], offset: int) -> tuple[dict, int]:
    """A completion choice's `logprobs` object for these tokens, whose text starts at character
    `offset` of the completion; returns it with the offset after them."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(e.token)
        offset += len(e.token)
    top = [{**{t.token: _value(t.logprob) for t in e.top}, e.token: _value(e.logprob)} for e in entries]
    return {"tokens": tokens, "token_logprobs": [_value(e.logprob) for e in entries],
            "top_logprobs": top, "text_offset": offsets}, offset


def _token(entry) -> dict:
    return {"token": entry.token, "logprob": _value(entry.logprob), "bytes": list(entry.token.encode())}


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


def _finite(value, name: str, bad_request) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a finite number", name)
    return float(value)


def _integer(value, name: str, bad_request) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer", name)
    if not -2**31 <= value < 2**31:
        raise bad_request(f"'{name}' is out of range", name)
    return value
