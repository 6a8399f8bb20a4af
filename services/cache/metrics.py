"""Metrics of the cache service (names in the catalogue, services/common/metrics.py).

Prefix index: size (gauge), events applied and resyncs (counters, observed from the
live indexes), PrefixMatch latency and matched blocks. Result caches: lookups by kind
(`prefix`, `retrieval`, `tool`) and result (`hit`, `miss`, `wait`).
"""

from __future__ import annotations

import threading
import weakref

from opentelemetry.metrics import CallbackOptions, Observation

from services.common import metrics as catalogue
from services.common.instruments import counter, histogram

SERVICE = "cache"
INDEX_SIZE = "specmesh.cache.prefix_index.size"
INDEX_EVENTS = "specmesh.cache.prefix_index.events"
INDEX_RESYNCS = "specmesh.cache.prefix_index.resyncs"

_lock = threading.Lock()
_indexes: "weakref.WeakSet" = weakref.WeakSet()
_observers_created = False


def register_index(index) -> None:
    """Adds a prefix index to the observed set (the observable instruments are made once)."""
    global _observers_created
    with _lock:
        _indexes.add(index)
        if _observers_created:
            return
        _observers_created = True
    from services.common.telemetry import meter
    m = meter(SERVICE)
    m.create_observable_gauge(INDEX_SIZE, [_observer("size")], unit="{block}",
                              description="(replica, block) entries in the prefix index")
    m.create_observable_counter(INDEX_EVENTS, [_observer("events_applied")], unit="{event}",
                                description="KV events applied to the prefix index")
    m.create_observable_counter(INDEX_RESYNCS, [_observer("resyncs")], unit="{snapshot}",
                                description="snapshots applied (start, reconnect, sequence gap)")


def count_lookup(kind: str, result: str) -> None:
    counter(SERVICE, catalogue.CACHE_LOOKUPS).add(
        1, {"specmesh.cache.kind": kind, "specmesh.cache.result": result})


def record_prefix_match(seconds: float, matched_blocks: int) -> None:
    histogram(SERVICE, catalogue.PREFIX_QUERY_TIME).record(seconds)
    counter(SERVICE, catalogue.PREFIX_MATCHED_BLOCKS).add(matched_blocks)


def _observer(field: str):
    def observe(options: CallbackOptions):
        total = sum(getattr(index, field) for index in list(_indexes))
        yield Observation(total)
    return observe
