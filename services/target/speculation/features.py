"""The target's side of the feature head (EAGLE): features of committed positions not yet sent.

`FeatureBuffer` is the one owner of them. After each forward pass the speculator adds, for
every sequence speculating with the head, the features of the positions that pass committed
(a prefill chunk's or decode step's rows; a verify pass's root and accepted nodes); the next
draft call takes them (DraftRequest.features -> DraftSequence.features). A draft call that
fails loses them: the draft then sees a gap and restarts its context after it (that step
decodes plainly, output unchanged). Features of positions that are not right after the
pending ones (preemption recomputes a prefix) replace them.
"""

from __future__ import annotations

import torch


class FeatureBuffer:
    def __init__(self) -> None:
        self._pending: dict[str, tuple[int, list[torch.Tensor]]] = {}  # seq_id -> (start, [rows [m, hidden]])

    def add(self, seq_id: str, start: int, rows: torch.Tensor) -> None:
        """rows [m, hidden]: features of positions start .. start + m - 1."""
        if not len(rows):
            return
        pending = self._pending.get(seq_id)
        if pending is not None and pending[0] + sum(len(r) for r in pending[1]) == start:
            pending[1].append(rows)
        else:
            self._pending[seq_id] = (start, [rows])

    def take(self, seq_id: str) -> tuple[int, torch.Tensor] | None:
        """(start, rows [m, hidden]) of the pending features, which are then forgotten; None if none."""
        pending = self._pending.pop(seq_id, None)
        if pending is None:
            return None
        start, rows = pending
        return start, rows[0] if len(rows) == 1 else torch.cat(rows)

    def drop(self, seq_id: str) -> None:
        self._pending.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._pending)
