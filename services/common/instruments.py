"""The metric instruments of a service, created once from the catalogue (`metrics.py`) on the
service's meter (`telemetry.py`). The catalogue stays data, so telemetry can read its views
without importing what creates instruments."""

from __future__ import annotations

import threading

from services.common.metrics import COUNTERS, HISTOGRAMS
from services.common.telemetry import meter

_lock = threading.Lock()
_instruments: dict[tuple[str, str], object] = {}


def histogram(service: str, name: str):
    """The service's histogram `name` (created once; boundaries come from VIEWS)."""
    unit, _, description = HISTOGRAMS[name]
    return _get(service, name, lambda m: m.create_histogram(name, unit=unit, description=description))


def counter(service: str, name: str):
    unit, description = COUNTERS[name]
    return _get(service, name, lambda m: m.create_counter(name, unit=unit, description=description))


def _get(service: str, name: str, create):
    key = (service, name)
    instrument = _instruments.get(key)
    if instrument is None:
        with _lock:
            instrument = _instruments.get(key)
            if instrument is None:
                instrument = _instruments[key] = create(meter(service))
    return instrument
