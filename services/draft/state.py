"""Per-sequence draft state: the committed token history of every sequence.

`DraftStateStore` is the one owner of this state. The service
validates a whole request first and only then calls `append` / `release`, so a bad
request changes nothing. Proposers read histories through `SequenceState` and keep
their own derived state (indexes) keyed by sequence id.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


def _token_array() -> array:
    tokens = array("i")
    assert tokens.itemsize == 4, "token histories are stored as 32-bit ints"
    return tokens


@dataclass
class SequenceState:
    """The committed tokens of one sequence and what it was opened with.

    `token_ids` is owned by the store: readers must not modify it or keep buffer
    views of it (an exported buffer would block appends).
    """

    sequence_id: str
    tenant_salt: str
    method: int  # common_pb2.SpeculationMethod, normalized (never UNSPECIFIED)
    token_ids: array = field(default_factory=_token_array)  # [num_committed_tokens], int32
    last_used: float = 0.0  # the store's clock at the last append

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftStateStore:
    """Owns the `SequenceState` of every open sequence."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._states: dict[str, SequenceState] = {}  # least recently used first
        self._clock = clock

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._states

    def get(self, sequence_id: str) -> SequenceState | None:
        return self._states.get(sequence_id)

    def append(self, sequence_id: str, new_token_ids: Sequence[int], tenant_salt: str,
               method: int) -> SequenceState:
        """Opens the sequence (first call: `new_token_ids` is the prompt) or appends
        committed tokens to it. The caller has validated the request."""
        state = self._states.get(sequence_id)
        if state is None:
            if not new_token_ids:
                raise ValueError(f"new sequence {sequence_id!r} needs its prompt tokens")
            state = SequenceState(sequence_id, tenant_salt, method)
            self._states[sequence_id] = state
        elif state.tenant_salt != tenant_salt or state.method != method:
            raise ValueError(f"sequence {sequence_id!r} was opened with another tenant or method")
        else:
            self._states[sequence_id] = self._states.pop(sequence_id)  # now the most recently used
        state.token_ids.extend(new_token_ids)
        state.last_used = self._clock()
        return state

    def idle(self, ttl_s: float) -> list[str]:
        """Sequences not appended to for more than `ttl_s` (a target whose Release never
        arrived); O(number found), oldest first."""
        cutoff = self._clock() - ttl_s
        out = []
        for sequence_id, state in self._states.items():
            if state.last_used >= cutoff:
                break
            out.append(sequence_id)
        return out

    def release(self, sequence_ids: Iterable[str]) -> tuple[int, int]:
        """Drops the given sequences. Returns (released, unknown) counts."""
        released = unknown = 0
        for sequence_id in sequence_ids:
            if self._states.pop(sequence_id, None) is None:
                unknown += 1
            else:
                released += 1
        return released, unknown
