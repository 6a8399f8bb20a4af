"""Validated sampling parameters shared by the router and the target (no torch here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specmesh.proto.v1 import common_pb2

MAX_PENALTY = 2.0  # presence / frequency penalty range [-2, 2] (OpenAI's)
MAX_REPETITION_PENALTY = 2.0
MAX_LOGIT_BIAS = 300  # entries per request
MAX_BIAS = 100.0  # bias range [-100, 100] (OpenAI's)
MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's limit)


@dataclass(frozen=True)
class SamplingConfig:
    """Validated sampling parameters of one request (0 = off for top_k / top_p)."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    skip_special_tokens: bool = True  # control tokens stay out of the text (ids stream anyway)
    # Penalties, bias, min_tokens and log-probabilities (services/target/model/logits_processors.py,
    # services/target/model/logprobs.py); 0 / empty = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0  # 0 = off, the same as 1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    raw_logprobs: bool = False

    def __post_init__(self) -> None:
        errors = sampling_errors(self.max_tokens, self.temperature, self.top_k, self.top_p, self.stop)
        errors += [m for _, m in surface_violations(
            self.max_tokens, self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
            dict(self.logit_bias), self.min_tokens, self.logprobs, self.top_logprobs, self.raw_logprobs)]
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """True when a penalty, a bias or min_tokens changes the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty not in (0.0, 1.0) or self.min_tokens)


def sampling_errors(max_tokens: int, temperature: float, top_k: int, top_p: float,
                    stop: tuple[str, ...] = ()) -> list[str]:
    """Human-readable problems with sampling parameters (empty when valid)."""
    return [message for _, message in sampling_violations(max_tokens, temperature, top_k, top_p, stop)]


def sampling_violations(max_tokens: int, temperature: float, top_k: int, top_p: float,
                        stop: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(field, problem) pairs, fields named as in SamplingParams (empty when valid)."""
    errors = []
    if max_tokens <= 0:
        errors.append(("max_tokens", f"max_tokens must be > 0, got {max_tokens}"))
    if not math.isfinite(temperature) or temperature < 0:
        errors.append(("temperature", f"temperature must be finite and >= 0, got {temperature}"))
    if top_k < 0:
        errors.append(("top_k", f"top_k must be >= 0 (0 = off), got {top_k}"))
    if not math.isfinite(top_p) or not (top_p == 0.0 or 0.0 < top_p <= 1.0):
        errors.append(("top_p", f"top_p must be in (0, 1] (0 = off), got {top_p}"))
    if any(s == "" for s in stop):
        errors.append(("stop", "stop sequences must not be empty strings"))
    return errors


def surface_violations(max_tokens: int, presence_penalty: float, frequency_penalty: float,
                       repetition_penalty: float, logit_bias: dict[int, float], min_tokens: int,
                       logprobs: bool, top_logprobs: int, raw_logprobs: bool) -> list[tuple[str, str]]:
    """(field, problem) pairs for penalties, bias, min_tokens and log-probabilities. Token ids
    are checked against the vocabulary by the target (only it knows the model)."""
    errors = []
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            errors.append((name, f"{name} must be finite and in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}"))
    if not math.isfinite(repetition_penalty) or not 0.0 <= repetition_penalty <= MAX_REPETITION_PENALTY:
        errors.append(("repetition_penalty", f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] "
                                             f"(0 = off), got {repetition_penalty}"))
    if len(logit_bias) > MAX_LOGIT_BIAS:
        errors.append(("logit_bias", f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS}"))
    bad_ids = sorted(t for t in logit_bias if t < 0)
    if bad_ids:
        errors.append(("logit_bias", f"logit_bias token ids must be >= 0, got {bad_ids[0]}"))
    bad = [b for b in logit_bias.values() if not math.isfinite(b) or not -MAX_BIAS <= b <= MAX_BIAS]
    if bad:
        errors.append(("logit_bias", f"logit_bias values must be finite and in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                     f"got {bad[0]}"))
    if min_tokens < 0 or min_tokens > max_tokens:
        errors.append(("min_tokens", f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}"))
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        errors.append(("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}"))
    elif top_logprobs and not logprobs:
        errors.append(("top_logprobs", "top_logprobs needs logprobs set"))
    if raw_logprobs and not logprobs:
        errors.append(("raw_logprobs", "raw_logprobs needs logprobs set"))
    return errors


def params_violations(params: common_pb2.SamplingParams) -> list[tuple[str, str]]:
    """Every (field, problem) pair of a SamplingParams message (empty when valid)."""
    return [*sampling_violations(params.max_tokens, params.temperature, params.top_k, params.top_p,
                                 tuple(params.stop)),
            *surface_violations(params.max_tokens, params.presence_penalty, params.frequency_penalty,
                                params.repetition_penalty, dict(params.logit_bias), params.min_tokens,
                                params.logprobs, params.top_logprobs, params.raw_logprobs)]


def sampling_from_proto(params: common_pb2.SamplingParams) -> SamplingConfig:
    """Raises ValueError with every problem listed when the parameters are invalid."""
    return SamplingConfig(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed if params.has_seed else None,
        stop=tuple(params.stop),
        skip_special_tokens=(params.skip_special_tokens if params.HasField("skip_special_tokens")
                             else True),  # unset = skip, as vLLM
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=tuple(sorted(params.logit_bias.items())),
        min_tokens=params.min_tokens,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        raw_logprobs=params.raw_logprobs,
    )
