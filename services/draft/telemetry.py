"""The draft service's metrics and its part of each request's trace.

Per sequence, one `draft.sequence` span, a child of the target's request span (its W3C
`traceparent` arrives on the sequence's first DraftSequence), open from the first proposal
to Release, with the totals as attributes: proposals, proposed tokens, time spent. No span
per proposal: the draft answers once per target step for every speculating sequence.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common import metrics as m
from services.common.instruments import counter, histogram
from services.common.telemetry import tracer

SERVICE = "draft"
MAX_OPEN_SPANS = 10_000  # sequences never released (a target died) end oldest first
_PROPAGATOR = TraceContextTextMapPropagator()


class DraftTelemetry:
    def __init__(self) -> None:
        self._spans: OrderedDict[str, list] = OrderedDict()  # seq id -> [span, proposals, tokens, seconds]
        self._time = histogram(SERVICE, m.DRAFT_PROPOSE_TIME)
        self._sequences = counter(SERVICE, m.DRAFT_SEQUENCES)
        self._proposed = counter(SERVICE, m.DRAFT_PROPOSED)

    def proposed(self, sequences, methods: list[str], trees, seconds: float) -> None:
        """One answered request: `sequences` its DraftSequence messages, `trees` the answers."""
        self._time.record(seconds)
        per_method: dict[str, list[int]] = {}
        for seq, method, tree in zip(sequences, methods, trees):
            counts = per_method.setdefault(method, [0, 0])
            counts[0] += 1
            counts[1] += tree.num_nodes
            entry = self._spans.get(seq.sequence_id)
            if entry is None and seq.traceparent:
                entry = self._open(seq.sequence_id, seq.traceparent, method)
            if entry is not None:
                entry[1] += 1
                entry[2] += tree.num_nodes
                entry[3] += seconds
        for method, (num_sequences, num_tokens) in per_method.items():
            self._sequences.add(num_sequences, {"specmesh.speculation.method": method})
            self._proposed.add(num_tokens, {"specmesh.speculation.method": method})

    def released(self, sequence_ids) -> None:
        for sequence_id in sequence_ids:
            entry = self._spans.pop(sequence_id, None)
            if entry is not None:
                _end(entry)

    def _open(self, sequence_id: str, traceparent: str, method: str) -> list:
        parent = _PROPAGATOR.extract({"traceparent": traceparent})
        span = tracer(SERVICE).start_span("draft.sequence", context=parent, attributes={
            "specmesh.speculation.method": method})
        entry = self._spans[sequence_id] = [span, 0, 0, 0.0]
        while len(self._spans) > MAX_OPEN_SPANS:
            _end(self._spans.popitem(last=False)[1])
        return entry


def _end(entry: list) -> None:
    span, proposals, tokens, seconds = entry
    span.set_attribute("specmesh.draft.proposals", proposals)
    span.set_attribute("specmesh.proposed_tokens", tokens)
    span.set_attribute("specmesh.draft_time_ms", round(seconds * 1000, 3))
    span.end(end_time=time.time_ns())
