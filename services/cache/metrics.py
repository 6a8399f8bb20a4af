"""OpenTelemetry metrics of the cache service (instruments created once per process).

Prefix index: size (gauge), events applied and resyncs (counters), query latency.
Result caches: lookups by kind (`prefix`, `retrieval`, `tool`) and outcome (`hit`,
`miss`, `wait`, ...), so hit rates can be read per cache kind.
"""

from __future__ import annotations

import threading
import weakref

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

_lock = threading.Lock()
_indexes: "weakref.WeakSet" = weakref.WeakSet()
_instruments: dict | None = None


def register_index(index) -> dict:
    """Adds a prefix index to the observed set; returns the shared instruments."""
    with _lock:
        _indexes.add(index)
        return _get()


def instruments() -> dict:
    with _lock:
        return _get()


def _get() -> dict:
    global _instruments
    if _instruments is None:
        _instruments = _create()
    return _instruments


def _create() -> dict:
    meter = metrics.get_meter("specmesh.cache")
    meter.create_observable_gauge("specmesh.cache.prefix_index.size", [_observer("size")],
                                  unit="{block}", description="(replica, block) entries in the prefix index")
    meter.create_observable_counter("specmesh.cache.prefix_index.events",
                                    [_observer("events_applied")], unit="{event}",
                                    description="KV events applied to the prefix index")
    meter.create_observable_counter("specmesh.cache.prefix_index.resyncs", [_observer("resyncs")],
                                    unit="{snapshot}",
                                    description="snapshots applied (start, reconnect, sequence gap)")
    return {
        "query_latency": meter.create_histogram(
            "specmesh.cache.prefix_index.query_duration", unit="s",
            description="time to answer one PrefixMatch"),
        "lookups": meter.create_counter(
            "specmesh.cache.lookups", unit="{lookup}",
            description="cache lookups by specmesh.cache_kind and specmesh.outcome "
                        "(hit, miss, wait, error)"),
        "saved_blocks": meter.create_counter(
            "specmesh.cache.prefix_index.matched_blocks", unit="{block}",
            description="leading blocks found on the best replica per PrefixMatch"),
    }


def _observer(field: str):
    def observe(options: CallbackOptions):
        for index in list(_indexes):
            yield Observation(getattr(index, field))
    return observe
