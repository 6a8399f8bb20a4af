"""What each engine step carried, and which steps each request waited through before its
first token and after it: the record that tells where a time to first token, and a time
per output token, went.

The engine appends one `StepRecord` per step and one `FirstToken` per request when its first
token commits (engine thread only; bounded, oldest dropped). A request's first-token wait
is then, read from the two logs: queue (arrival -> admission), the steps it shared with
other sequences' verify rows, and its own prefill chunks (`waited_steps`). The P99 benchmark
(benchmarks/p99_incident.py) reads them from the engine it runs in-process.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    index: int  # the engine's step number (Engine.num_steps)
    start: float  # monotonic seconds: scheduled, before the draft call
    end: float  # after the bookkeeping: its tokens were emitted
    draft_s: float  # this step's draft call (0 when none)
    prefill_tokens: int  # prompt-chunk tokens computed (requests waiting for their first token)
    decode_rows: int  # sequences decoding (plain or verifying)
    draft_nodes: int  # draft-tree nodes verified: extra rows of the forward pass
    trees: int  # sequences verifying a draft tree
    waiting: int  # requests left waiting after scheduling (no seat, budget or blocks)


@dataclass(frozen=True)
class FirstToken:
    request_id: str
    bucket: str
    arrival: float  # monotonic: submitted to the engine
    admitted: float  # first admission (its queue wait ended)
    first_token: float  # its first token was committed
    cached_prompt_tokens: int
    prompt_tokens: int


class StepLog:
    def __init__(self, capacity: int = 100_000) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=capacity)
        self.first_tokens: deque[FirstToken] = deque(maxlen=capacity)

    def snapshot(self) -> tuple[list[StepRecord], list[FirstToken]]:
        """Copies of both logs (call on the engine thread, or accept a step's worth of skew)."""
        return list(self.steps), list(self.first_tokens)


def waited_steps(first: FirstToken, steps: list[StepRecord]) -> list[StepRecord]:
    """The steps that ran while `first`'s request waited for its first token: every step
    that ended after it arrived and started before its first token (the step it arrived in,
    the steps it queued through, its prefill steps)."""
    return [s for s in steps if s.end > first.arrival and s.start < first.first_token]


def first_token_breakdown(first: FirstToken, steps: list[StepRecord]) -> dict:
    """Where the engine's share of one first-token wait went (seconds and counts)."""
    waited = waited_steps(first, steps)
    spec = [s for s in waited if s.draft_nodes or s.draft_s]
    return {"queue_s": first.admitted - first.arrival,
            "engine_s": first.first_token - first.arrival,
            "steps": len(waited),
            "steps_with_prefill": sum(1 for s in waited if s.prefill_tokens),
            "steps_with_verify": len(spec),
            "verify_step_s": sum(s.end - s.start for s in spec),
            "draft_call_s": sum(s.draft_s for s in spec),
            "draft_nodes": sum(s.draft_nodes for s in spec),
            "max_waiting": max((s.waiting for s in waited), default=0)}


def decode_breakdown(first_token: float, end: float, steps: list[StepRecord]) -> dict:
    """What the steps between a request's first token and its last (monotonic) carried: its
    time per output token is their mean length (`steps` in start order). A request whose
    batch-mates speculated shows verify rows here; one slowed by a prefill burst, prefill
    tokens; one slowed by the machine (other load), long steps carrying neither."""
    starts = [s.start for s in steps]
    lo, hi = bisect.bisect_left(starts, first_token), bisect.bisect_left(starts, end)
    mine = steps[lo:hi]
    if not mine:
        return {"decode_steps": 0}
    n = len(mine)
    return {"decode_steps": n,
            "decode_step_s": sum(s.end - s.start for s in mine) / n,
            "decode_rows": sum(s.decode_rows for s in mine) / n,
            "decode_prefill_tokens": sum(s.prefill_tokens for s in mine) / n,
            "decode_draft_nodes": sum(s.draft_nodes for s in mine) / n,
            "decode_draft_s": sum(s.draft_s for s in mine) / n}
