"""The target's side of the feature head (EAGLE): features of committed positions not yet sent.

`FeatureBuffer` is the one owner of them. After each forward pass the speculator adds, for
every sequence speculating with the head, the features of the positions that pass committed
(a prefill chunk's or decode step's rows; a verify pass's root and accepted nodes); the next
draft call takes them (DraftRequest.features -> DraftSequence.features). A draft call that
fails loses them: the draft then sees a gap and restarts its context after it (that step
decodes plainly, output unchanged). Features of positions that are not right after the
pending ones (preemption recomputes a prefix) replace them. One call carries at most
MAX_FEATURE_BYTES of them (`fit_features`: a long prompt's oldest rows are left out and the head
starts its context after them).
"""

from __future__ import annotations

import torch

from services.common.feature_rows import BYTES_PER_VALUE

# Feature bytes one draft call carries at most: the draft server receives messages of up to gRPC's
# default 4 MiB, and the tokens and trees' fields need the rest.
MAX_FEATURE_BYTES = 3 << 20


class FeatureBuffer:
    def __init__(self) -> None:
        self._pending: dict[str, tuple[int, list[torch.Tensor]]] = {}  # seq_id -> (start, [rows [m, hidden]])

    def add(self, seq_id: str, start: int, rows: torch.Tensor) -> None:
        """rows [m, hidden]: features of positions start .. start + m - 1."""
        if not len(rows):
            return
        if self.end(seq_id) == start:
            self._pending[seq_id][1].append(rows)
        else:
            self._pending[seq_id] = (start, [rows])

    def end(self, seq_id: str) -> int | None:
        """The position after the pending features (None if none): where a continuing run starts."""
        pending = self._pending.get(seq_id)
        return None if pending is None else pending[0] + sum(len(r) for r in pending[1])

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


Features = tuple[int, torch.Tensor] | None  # (start, rows [m, hidden]) of one draft request, or none


def fit_features(features: list[Features], max_bytes: int) -> list[Features]:
    """The calls' (start, rows [m, hidden]) features cut to `max_bytes` on the wire in all: while
    over, the largest keep their newest rows, an equal share each (the others as they are)."""
    sizes = [0 if f is None else f[1].shape[0] * f[1].shape[1] * BYTES_PER_VALUE for f in features]
    if sum(sizes) <= max_bytes:
        return features
    order = sorted((i for i, size in enumerate(sizes) if size), key=sizes.__getitem__)
    out, left = list(features), max_bytes
    for n, i in enumerate(order):
        share = left // (len(order) - n)  # what is left, shared by this one and the larger ones after it
        start, rows = features[i]
        if sizes[i] > share:
            keep = share // (rows.shape[1] * BYTES_PER_VALUE)
            out[i] = None if keep == 0 else (start + rows.shape[0] - keep, rows[rows.shape[0] - keep:])
            left -= keep * rows.shape[1] * BYTES_PER_VALUE
        else:
            left -= sizes[i]
    return out
