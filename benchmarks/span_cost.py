"""What one span per verify pass would cost the engine thread, against what it pays now.

    python benchmarks/span_cost.py

Per speculating sequence and verify pass, the engine thread now appends one list of six
numbers (services/target/speculation/speculator.py `verify_span`); the request's `draft.propose` /
`verify` spans and per-pass events are written by a background thread when the request
finishes. The alternative, a child span per pass for `draft.propose` and one for `verify`,
would run on the engine thread. Compare the per-pass costs printed here with the step time
(`specmesh.speculation.verify_time` / `specmesh.batch.size`, or benchmarks/engine_throughput.py).
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def per_call_us(fn, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e6


def main(n: int = 20000) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "span-cost"}))
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter(), max_queue_size=n * 2))
    tracer = provider.get_tracer("span-cost")
    root = tracer.start_span("request")
    parent = trace.set_span_in_context(trace.NonRecordingSpan(root.get_span_context()))
    notes: list = []

    def two_spans(i: int) -> None:
        for name in ("draft.propose", "verify"):
            now = time.time_ns()
            span = tracer.start_span(name, context=parent, start_time=now,
                                     attributes={"specmesh.proposed_tokens": 5, "specmesh.accepted_tokens": 3})
            span.end(end_time=now + 1000)

    def event(i: int) -> None:
        root.add_event("verify.pass", {"specmesh.proposed_tokens": 5, "specmesh.accepted_tokens": 3})

    def note(i: int) -> None:
        notes.append([0.1, 0.2, 0.3, 0.4, 5, 3])

    spans_us = per_call_us(two_spans, n)
    print(f"two spans per pass (engine thread):   {spans_us:8.1f} us per sequence per step")
    print(f"one event per pass:                   {per_call_us(event, n):8.1f} us")
    print(f"a note per pass (what the engine does): {per_call_us(note, n):6.2f} us")
    for batch, step_ms in ((1, 40.0), (16, 80.0)):
        print(f"  batch {batch:>2}, step {step_ms:.0f} ms: spans would add "
              f"{spans_us * batch / (step_ms * 1000) * 100:.1f}% to the step")


if __name__ == "__main__":
    main()
