"""The `specmesh.draft.open_sequences` gauge: sequences the draft services of this process hold
state for (what a lost Release leaves behind; at DraftConfig.max_sequences new ones are refused)."""

from __future__ import annotations

import threading
import weakref

from opentelemetry.metrics import CallbackOptions, Observation

from services.common import metrics as m
from services.common.telemetry import meter

OPEN_SEQUENCES = m.DRAFT_OPEN_SEQUENCES
_stores: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()
_created = False


def observe_open_sequences(store) -> None:
    """Reports `len(store)` on the gauge while the store lives."""
    global _created
    with _lock:
        _stores.add(store)
        if not _created:
            unit, description = m.GAUGES[OPEN_SEQUENCES]
            meter("draft").create_observable_gauge(OPEN_SEQUENCES, [_observe], unit=unit,
                                                   description=description)
            _created = True


def _observe(options: CallbackOptions):
    yield Observation(sum(len(store) for store in list(_stores)))
