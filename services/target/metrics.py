"""Metrics and per-request trace phases of the target engines in this process.

KV gauges are observable callbacks over every live engine (`specmesh.model`,
`specmesh.engine` attributes). Request metrics carry the request's bucket, pool
(the model name) and speculation method.

Trace phases: the engine thread only notes timestamps (queue admission, first token,
each verify pass's draft and verify windows; a few microseconds). When a request
finishes, a background thread writes its `queue`, `prefill`, `draft.propose` and
`verify` spans as children of the request's span, with one event per verify pass on
the `verify` span. Spans per pass would cost more than 2% of a step (measured: see
docs/observability.md); events written off the engine thread cost it nothing.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import NonRecordingSpan

from services.common import instruments, metrics as m
from services.common.telemetry import meter, record_error, tracer

_lock = threading.Lock()
_engines: "weakref.WeakSet" = weakref.WeakSet()
_gauges_created = False
SERVICE = "target"

# name -> (EngineStats field, unit, description)
_GAUGES = {
    "specmesh.kv.blocks.used": ("used_blocks", "{block}", "KV blocks referenced by a sequence"),
    "specmesh.kv.blocks.cached": ("cached_blocks", "{block}", "KV blocks in the prefix cache"),
    "specmesh.kv.blocks.free": ("free_blocks", "{block}", "KV blocks that can be allocated"),
    "specmesh.kv.blocks.total": ("num_blocks", "{block}", "KV blocks in the pool"),
    "specmesh.kv.bytes": ("kv_bytes", "By", "bytes of the KV pool"),
    "specmesh.kv.fragmentation": ("fragmentation", "1", "allocated-but-unused slots / allocated slots"),
    "specmesh.queue.depth": ("waiting", "{request}", "requests waiting for admission"),
    "specmesh.running": ("running", "{request}", "requests being decoded"),
    "specmesh.kv.host.bytes": ("host_tier_bytes", "By", "bytes held by the host tier below the KV pool"),
    "specmesh.kv.host.capacity": ("host_tier_capacity_bytes", "By", "byte bound of the host tier"),
    "specmesh.kv.host.blocks": ("host_tier_blocks", "{block}", "KV blocks held by the host tier"),
    "specmesh.kv.host.swap_bytes": ("host_tier_swap_bytes", "By",
                                    "bytes of the host tier held for swapped-out sequences"),
    "specmesh.kv.host.fp8_blocks": ("host_tier_cold_blocks", "{block}",
                                    "host-tier blocks held in FP8 (kv_cold_precision; the rest in full precision)"),
    "specmesh.kv.host.fp8_bytes": ("host_tier_cold_bytes", "By", "bytes of the host tier held by its FP8 blocks"),
    "specmesh.kv.shared.bytes": ("shared_tier_bytes", "By", "bytes of this replica's entries in the shared tier"),
    "specmesh.kv.shared.capacity": ("shared_tier_capacity_bytes", "By", "this replica's byte bound in the shared tier"),
}
_COUNTERS = {
    "specmesh.kv.evictions": ("evictions", "{block}", "cached blocks evicted"),
    "specmesh.preemptions": ("num_preemptions", "{preemption}", "sequences preempted (swapped or recomputed)"),
    "specmesh.preemptions.swapped": ("swap_preemptions", "{preemption}",
                                     "preempted sequences swapped out to the host tier and back"),
    "specmesh.preemptions.recomputed": ("recompute_preemptions", "{preemption}",
                                        "preempted sequences recomputed"),
    "specmesh.prefix.queries": ("prefix_queries", "{query}", "prefix-cache lookups"),
    "specmesh.prefix.query_tokens": ("prefix_query_tokens", "{token}", "prompt tokens looked up"),
    "specmesh.prefix.hit_tokens": ("prefix_hit_tokens", "{token}", "prompt tokens served from cache"),
    "specmesh.kv.host.stored": ("host_tier_stored_blocks", "{block}", "evicted KV blocks stored in the host tier"),
    "specmesh.kv.host.hits": ("host_tier_restored_blocks", "{block}",
                              "KV blocks restored from the host tier instead of recomputed"),
    "specmesh.kv.host.hit_tokens": ("host_tier_restored_tokens", "{token}",
                                    "prompt tokens restored from the host tier (part of hit_tokens)"),
    "specmesh.kv.host.dropped": ("host_tier_dropped_blocks", "{block}", "host-tier blocks dropped for its bound"),
    "specmesh.kv.host.rejected": ("host_tier_rejected_blocks", "{block}",
                                  "host-tier blocks failing their identity or checksum check (recomputed)"),
    "specmesh.kv.host.store_time": ("host_tier_store_seconds", "s", "time spent storing blocks in the host tier"),
    "specmesh.kv.host.restore_time": ("host_tier_restore_seconds", "s",
                                      "time spent checking and restoring host-tier blocks"),
    "specmesh.kv.host.swapped_out": ("host_tier_swapped_out_blocks", "{block}",
                                     "preempted sequences' KV blocks swapped out to the host tier"),
    "specmesh.kv.host.swapped_in": ("host_tier_swapped_in_blocks", "{block}",
                                    "swapped KV blocks copied back when their sequence resumed"),
    "specmesh.kv.host.fp8_stored": ("host_tier_cold_stored_blocks", "{block}",
                                    "evicted KV blocks stored in the host tier in FP8"),
    "specmesh.kv.host.fp8_restored": ("host_tier_cold_restored_blocks", "{block}",
                                      "host-tier blocks restored from FP8 (dequantized into the pool)"),
    "specmesh.kv.host.fp8_swapped_out": ("host_tier_cold_swapped_out_blocks", "{block}",
                                         "preempted sequences' KV blocks swapped out in FP8 (kv_cold_precision)"),
    "specmesh.kv.host.restore_bytes": ("host_tier_restore_bytes", "By",
                                       "bytes of host-tier entries restored into the pool, as stored (FP8 at "
                                       "their FP8 size): over restore_time, the measured restore bandwidth"),
    "specmesh.kv.host.swap_out_time": ("host_tier_swap_out_seconds", "s", "time spent swapping KV out"),
    "specmesh.kv.host.swap_in_time": ("host_tier_swap_in_seconds", "s", "time spent swapping KV back in"),
    "specmesh.kv.shared.written": ("shared_tier_written_blocks", "{block}", "KV blocks written to the shared tier"),
    "specmesh.kv.shared.dropped": ("shared_tier_dropped_writes", "{block}",
                                   "shared-tier writes dropped (queue full, too big or Redis down)"),
    "specmesh.kv.shared.loaded": ("shared_tier_loaded_blocks", "{block}", "checked shared-tier blocks loaded"),
    "specmesh.kv.shared.hits": ("shared_tier_restored_blocks", "{block}",
                                "KV blocks restored from the shared tier instead of recomputed"),
    "specmesh.kv.shared.hit_tokens": ("shared_tier_restored_tokens", "{token}",
                                      "prompt tokens restored from the shared tier (part of hit_tokens)"),
    "specmesh.kv.shared.rejected": ("shared_tier_rejected_blocks", "{block}",
                                    "shared-tier entries failing their identity, key or checksum check"),
    "specmesh.kv.shared.errors": ("shared_tier_errors", "{call}", "shared-tier Redis calls failed or timed out"),
    "specmesh.kv.shared.write_time": ("shared_tier_write_seconds", "s", "time spent writing to the shared tier"),
    "specmesh.kv.shared.load_time": ("shared_tier_load_seconds", "s", "time spent loading from the shared tier"),
}


@dataclass
class Timeline:
    """When a request's phases happened (monotonic seconds). `arrival` is set when the
    sequence is made; the rest only by `TargetMetrics` (the scheduler reads `arrival`)."""

    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None  # the first admission: its queue wait ends
    first_token: float | None = None
    last_token: float | None = None


def exported_gauges() -> dict[str, tuple[str, str]]:
    """{name: (unit, "gauge" | "counter")} of the observable instruments (dashboard checks)."""
    return {**{n: (u, "gauge") for n, (_, u, _) in _GAUGES.items()},
            **{n: (u, "counter") for n, (_, u, _) in _COUNTERS.items()}}


def register_engine(engine) -> "TargetMetrics":
    """Adds an engine to the observed set; returns its request recorder."""
    global _gauges_created
    with _lock:
        _engines.add(engine)
        if not _gauges_created:
            _create_gauges()
            _gauges_created = True
    return TargetMetrics(engine.name)


class TargetMetrics:
    """Records one engine's request metrics; called on the engine thread."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        h, c = (lambda n: instruments.histogram(SERVICE, n)), (lambda n: instruments.counter(SERVICE, n))
        self._ttft, self._tpot, self._e2e = h(m.TTFT), h(m.TPOT), h(m.E2E)
        self._queue, self._prefill = h(m.QUEUE_TIME), h(m.PREFILL_TIME)
        self._verify, self._draft, self._accept_len = h(m.VERIFY_TIME), h(m.DRAFT_TIME), h(m.ACCEPTANCE_LENGTH)
        self._batch_size, self._batch_tokens = h(m.BATCH_SIZE), h(m.BATCH_TOKENS)
        self._requests, self._tokens, self._fallbacks = c(m.REQUESTS), c(m.TOKENS), c(m.FALLBACKS)
        self._proposed, self._accepted = c(m.PROPOSED_TOKENS), c(m.ACCEPTED_TOKENS)
        self._rejected = c(m.REJECTED_TOKENS)

    def attributes(self, seq) -> dict:
        return {"specmesh.bucket": seq.bucket, "specmesh.pool": self.pool,
                "specmesh.speculation.method": m.method_name(seq.plan.method if seq.plan else 0)}

    def step(self, batch) -> None:
        self._batch_size.record(len(batch))
        self._batch_tokens.record(sum(i.num_tokens for i in batch))

    def admitted(self, seq, now: float) -> None:
        seq.timeline.admitted = now
        self._queue.record(now - seq.timeline.arrival, self.attributes(seq))

    def emitted(self, seq, now: float, num_tokens: int) -> bool:
        """A step committed `num_tokens` of `seq`: its first token (TTFT, prefill), or the next
        ones (time per output token since the last emit). True when these began its output."""
        timeline = seq.timeline
        first = timeline.first_token is None
        if first:
            timeline.first_token = now
            attrs = self.attributes(seq)
            self._ttft.record(now - timeline.arrival, attrs)
            self._prefill.record(now - (timeline.admitted or timeline.arrival), attrs)
        elif timeline.last_token is not None:
            self._tpot.record((now - timeline.last_token) / num_tokens, self.attributes(seq))
        timeline.last_token = now
        return first

    def verify_pass(self, seq, proposed: int, accepted: int, draft_s: float, verify_s: float) -> None:
        attrs = self.attributes(seq)
        self._proposed.add(proposed, attrs)
        self._accepted.add(accepted, attrs)
        self._rejected.add(proposed - accepted, attrs)
        self._accept_len.record(accepted + 1, attrs)
        self._verify.record(verify_s, attrs)
        self._draft.record(draft_s, attrs)

    def fallback(self, seq) -> None:
        self._fallbacks.add(1, self.attributes(seq))

    def finished(self, seq, status: str) -> None:
        """`status`: the finish reason ("stop", "length", ...), "aborted" or "error"."""
        now = time.monotonic()
        attrs = self.attributes(seq)
        self._requests.add(1, {**attrs, "specmesh.status": status})
        if status not in ("aborted", "error"):
            self._e2e.record(now - seq.timeline.arrival, attrs)
            self._tokens.add(seq.num_prompt_tokens, {**attrs, "gen_ai.token.type": "input"})
            self._tokens.add(seq.num_cached_prompt, {**attrs, "gen_ai.token.type": "cached_input"})
            self._tokens.add(seq.num_output_tokens, {**attrs, "gen_ai.token.type": "output"})
        if seq.span_context is not None:
            timeline = seq.timeline
            _writer().put((seq.span_context, timeline.arrival, timeline.admitted, timeline.first_token,
                           now, list(seq.spec.passes), seq.spec.fallback_steps, status,
                           {"specmesh.cached_prompt_tokens": seq.num_cached_prompt,
                            "specmesh.host_cached_prompt_tokens": seq.num_host_cached_prompt,
                            "specmesh.shared_cached_prompt_tokens": seq.num_shared_cached_prompt}))


def flush_traces(timeout: float = 10.0) -> bool:
    """Waits until every finished request's phase spans are written (tests, shutdown)."""
    return _writer().flush(timeout)


# ---- helpers ----------------------------------------------------------------
def _create_gauges() -> None:
    meter_ = meter(SERVICE)
    for name, (field, unit, description) in _GAUGES.items():
        meter_.create_observable_gauge(name, [_observer(field)], unit=unit, description=description)
    for name, (field, unit, description) in _COUNTERS.items():
        meter_.create_observable_counter(name, [_observer(field)], unit=unit, description=description)


def _observer(field: str):
    def observe(options: CallbackOptions):
        for engine in list(_engines):
            stats = engine.stats()
            yield Observation(getattr(stats, field), {"specmesh.model": engine.name,
                                                      "specmesh.engine": engine.instance_id})
    return observe


_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def _ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


class _TraceWriter:
    """Writes finished requests' phase spans on its own thread."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="specmesh-trace-writer").start()

    def put(self, item) -> None:
        self._queue.put(item)

    def flush(self, timeout: float) -> bool:
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                _write_phases(*item)
            except Exception:  # telemetry never fails a request
                pass


def _write_phases(span_context, arrival, admitted, first_token, end, passes, fallbacks, status,
                  prefill_attributes=None) -> None:
    t = tracer(SERVICE)
    parent = trace.set_span_in_context(NonRecordingSpan(span_context))
    failed = status in ("error", "aborted")  # aborted: the caller cancelled or its deadline passed

    def span(name, start, stop, attributes=None, events=()):
        s = t.start_span(name, context=parent, start_time=_ns(start), attributes=attributes)
        for event_name, at, event_attrs in events:
            s.add_event(event_name, event_attrs, timestamp=_ns(at))
        if failed:
            record_error(s, "CANCELLED" if status == "aborted" else "INTERNAL", f"request {status}")
        s.end(end_time=_ns(stop))

    admitted = admitted or arrival
    span("queue", arrival, admitted)
    span("prefill", admitted, first_token or end, prefill_attributes)  # cached tokens by tier
    if passes or fallbacks:
        proposed = sum(p[4] for p in passes)
        accepted = sum(p[5] for p in passes)
        first, last = (passes[0], passes[-1]) if passes else ((end,) * 4, (end,) * 4)
        span("draft.propose", first[0], last[1], {
            "specmesh.verify_passes": len(passes), "specmesh.fallback_steps": fallbacks,
            "specmesh.draft_time_ms": round(sum(p[1] - p[0] for p in passes) * 1000, 3)})
        span("verify", first[2], last[3], {
            "specmesh.verify_passes": len(passes), "specmesh.proposed_tokens": proposed,
            "specmesh.accepted_tokens": accepted, "specmesh.rejected_tokens": proposed - accepted,
            "specmesh.verify_time_ms": round(sum(p[3] - p[2] for p in passes) * 1000, 3)},
            events=[("verify.pass", p[2], {"specmesh.proposed_tokens": p[4], "specmesh.accepted_tokens": p[5],
                                           "specmesh.draft_ms": round((p[1] - p[0]) * 1000, 3),
                                           "specmesh.verify_ms": round((p[3] - p[2]) * 1000, 3)})
                    for p in passes])


_writer_instance: _TraceWriter | None = None


def _writer() -> _TraceWriter:
    global _writer_instance
    with _lock:
        if _writer_instance is None:
            _writer_instance = _TraceWriter()
        return _writer_instance
