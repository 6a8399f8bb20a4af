"""OpenTelemetry metrics of the target engines in this process.

Instruments are created once per process; observable callbacks read every live
engine's stats and tag them with `specmesh.model` and a per-process `specmesh.engine` id.
"""

from __future__ import annotations

import threading
import weakref

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

_lock = threading.Lock()
_engines: "weakref.WeakSet" = weakref.WeakSet()
_instruments: dict | None = None

# name -> (EngineStats field, unit, description)
_GAUGES = {
    "specmesh.kv.blocks.used": ("used_blocks", "{block}", "KV blocks referenced by a sequence"),
    "specmesh.kv.blocks.cached": ("cached_blocks", "{block}", "KV blocks in the prefix cache"),
    "specmesh.kv.blocks.free": ("free_blocks", "{block}", "KV blocks that can be allocated"),
    "specmesh.kv.bytes": ("kv_bytes", "By", "bytes of the KV pool"),
    "specmesh.kv.fragmentation": ("fragmentation", "1", "allocated-but-unused slots / allocated slots"),
    "specmesh.queue.depth": ("waiting", "{request}", "requests waiting for admission"),
    "specmesh.running": ("running", "{request}", "requests being decoded"),
}
_COUNTERS = {
    "specmesh.kv.evictions": ("evictions", "{block}", "cached blocks evicted"),
    "specmesh.preemptions": ("num_preemptions", "{preemption}", "sequences preempted by recompute"),
    "specmesh.prefix.queries": ("prefix_queries", "{query}", "prefix-cache lookups"),
    "specmesh.prefix.query_tokens": ("prefix_query_tokens", "{token}", "prompt tokens looked up"),
    "specmesh.prefix.hit_tokens": ("prefix_hit_tokens", "{token}", "prompt tokens served from cache"),
}


def register_engine(engine) -> dict:
    """Adds an engine to the observed set; returns the shared histogram instruments."""
    global _instruments
    with _lock:
        _engines.add(engine)
        if _instruments is None:
            _instruments = _create()
        return _instruments


def _create() -> dict:
    meter = metrics.get_meter("specmesh.target")
    for name, (field, unit, description) in _GAUGES.items():
        meter.create_observable_gauge(name, [_observer(field)], unit=unit, description=description)
    for name, (field, unit, description) in _COUNTERS.items():
        meter.create_observable_counter(name, [_observer(field)], unit=unit, description=description)
    return {
        "ttft": meter.create_histogram("gen_ai.server.time_to_first_token", unit="s",
                                       description="time from arrival to the first token"),
        "tpot": meter.create_histogram("gen_ai.server.time_per_output_token", unit="s",
                                       description="time per output token after the first"),
        "batch_size": meter.create_histogram("specmesh.batch.size", unit="{sequence}",
                                             description="sequences per engine step"),
        "acceptance_length": meter.create_histogram(
            "specmesh.speculation.acceptance_length", unit="{token}",
            description="accepted + bonus tokens per verify pass, per bucket"),
        "fallbacks": meter.create_counter(
            "specmesh.speculation.fallbacks", unit="{step}",
            description="sequence steps that decoded normally because the draft failed"),
        "batch_tokens": meter.create_histogram("specmesh.batch.tokens", unit="{token}",
                                               description="tokens per engine step"),
    }


def _observer(field: str):
    def observe(options: CallbackOptions):
        for engine in list(_engines):
            stats = engine.stats()
            yield Observation(getattr(stats, field), {"specmesh.model": engine.name,
                                                      "specmesh.engine": engine.instance_id})
    return observe
