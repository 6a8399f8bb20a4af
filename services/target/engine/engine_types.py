"""Errors and statistics the engine hands to its callers."""

from __future__ import annotations

from dataclasses import dataclass


class InvalidRequest(ValueError):
    """The request can never be served as given (maps to INVALID_ARGUMENT)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field  # the offending request field, e.g. "sampling.logit_bias" ("" = none named)


class DuplicateRequest(InvalidRequest):
    """A request id already in flight; the request holding it is not affected."""


class Overloaded(RuntimeError):
    """Admission limits are reached (maps to RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    block_size: int
    running: int
    waiting: int
    queued_tokens: int
    num_preemptions: int
    evictions: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    kv_bytes: int
    fragmentation: float  # allocated-but-unused slots / allocated slots
    prompt_tokens_computed: int = 0  # prompt positions computed (not served by the prefix cache or a fork)


class EngineFailed(RuntimeError):
    """The engine's loop failed outside a step and stopped: its state can no longer be trusted.
    Live requests end with INTERNAL; new ones are refused (maps to UNAVAILABLE: another replica,
    or this one once its supervisor restarted it)."""
