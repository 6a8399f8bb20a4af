"""Validated sampling parameters shared by the router and the target (no torch here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specmesh.proto.v1 import common_pb2


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

    def __post_init__(self) -> None:
        errors = sampling_errors(self.max_tokens, self.temperature, self.top_k, self.top_p, self.stop)
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    )
