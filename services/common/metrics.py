"""The metric catalogue: every specmesh metric's name, unit, histogram boundaries and
description, declared once. Services record through `instruments.histogram(service, NAME)`
and `instruments.counter(service, NAME)`; the dashboard and its test read the names from here.

Names follow the OpenTelemetry GenAI semantic conventions where one exists
(`gen_ai.server.*`); the rest are `specmesh.*`. Attributes used across services:
`specmesh.bucket`, `specmesh.pool`, `specmesh.speculation.method`, and `rpc.grpc.status_code`
style status names in `specmesh.status`.

In Prometheus a name becomes `gen_ai_server_time_to_first_token_seconds_bucket{specmesh_bucket=..}`
(dots to underscores, the unit appended, `_total` on counters).
"""

from __future__ import annotations

from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

# Boundaries (seconds) suited to LLM serving: every sample in the first bucket says nothing.
LATENCY_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                  3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)  # TTFT, end to end: 5 ms .. 60 s
TPOT_BOUNDS = (0.001, 0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0)  # time per output token: 1 ms .. 2 s
PHASE_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0)  # queue, prefill, verify, draft: 0.5 ms .. 60 s
ACCEPTANCE_BOUNDS = tuple(float(n) for n in range(1, 18))  # accepted + bonus per verify pass
BATCH_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
LOOKUP_BOUNDS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                 0.025, 0.05, 0.1)  # in-memory index lookups: 10 us .. 100 ms

# ---- names ------------------------------------------------------------------
TTFT = "gen_ai.server.time_to_first_token"
TPOT = "gen_ai.server.time_per_output_token"
E2E = "gen_ai.server.request.duration"
QUEUE_TIME = "specmesh.request.queue_time"
PREFILL_TIME = "specmesh.request.prefill_time"
VERIFY_TIME = "specmesh.speculation.verify_time"
DRAFT_TIME = "specmesh.speculation.draft_time"
ACCEPTANCE_LENGTH = "specmesh.speculation.acceptance_length"
BATCH_SIZE = "specmesh.batch.size"
BATCH_TOKENS = "specmesh.batch.tokens"
RPC_DURATION = "rpc.server.call.duration"
DRAFT_PROPOSE_TIME = "specmesh.draft.propose_time"

REQUESTS = "specmesh.requests"
TOKENS = "specmesh.tokens"  # attribute gen_ai.token.type: input | cached_input | output
PROPOSED_TOKENS = "specmesh.speculation.proposed_tokens"
ACCEPTED_TOKENS = "specmesh.speculation.accepted_tokens"
REJECTED_TOKENS = "specmesh.speculation.rejected_tokens"
FALLBACKS = "specmesh.speculation.fallbacks"
# Recorded by services/router/route_metrics.py (declared here for the dashboard check):
ROUTES = "specmesh.router.routes"
ESCALATION_CANDIDATES = "specmesh.router.escalation_candidates"
UPGRADES = "specmesh.router.upgrades"
ROUTER_FALLBACKS = "specmesh.router.fallbacks"
RETRIES = "specmesh.router.retries"
DRAFT_SEQUENCES = "specmesh.draft.sequences"
DRAFT_PROPOSED = "specmesh.draft.proposed_tokens"
CACHE_LOOKUPS = "specmesh.cache.lookups"  # attributes specmesh.cache.kind, specmesh.cache.result
PREFIX_QUERY_TIME = "specmesh.cache.prefix_index.query_duration"
PREFIX_MATCHED_BLOCKS = "specmesh.cache.prefix_index.matched_blocks"
SAVED_PREFILL_TOKENS = "specmesh.cache.saved_prefill_tokens"  # attribute specmesh.cache.kind

# name -> (unit, boundaries, description)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...], str]] = {
    TTFT: ("s", LATENCY_BOUNDS, "time from arrival to the first output token"),
    TPOT: ("s", TPOT_BOUNDS, "time per output token after the first"),
    E2E: ("s", LATENCY_BOUNDS, "time from arrival to the last token"),
    QUEUE_TIME: ("s", PHASE_BOUNDS, "time from arrival to admission into the running batch"),
    PREFILL_TIME: ("s", PHASE_BOUNDS, "time from admission to the first output token"),
    VERIFY_TIME: ("s", PHASE_BOUNDS, "verify forward pass time, per speculating sequence and pass"),
    DRAFT_TIME: ("s", PHASE_BOUNDS, "time the target waited for the draft, per sequence and pass"),
    ACCEPTANCE_LENGTH: ("{token}", ACCEPTANCE_BOUNDS, "accepted + bonus tokens per verify pass"),
    BATCH_SIZE: ("{sequence}", BATCH_BOUNDS, "sequences per engine step"),
    BATCH_TOKENS: ("{token}", BATCH_BOUNDS, "tokens per engine step"),
    RPC_DURATION: ("s", LATENCY_BOUNDS, "gRPC call duration on the server, by method and status"),
    DRAFT_PROPOSE_TIME: ("s", PHASE_BOUNDS, "draft service time per batched proposal"),
    PREFIX_QUERY_TIME: ("s", LOOKUP_BOUNDS, "cache service time to answer one PrefixMatch"),
}
# name -> (unit, description)
COUNTERS: dict[str, tuple[str, str]] = {
    REQUESTS: ("{request}", "finished requests by status"),
    TOKENS: ("{token}", "prompt (input), cached prompt (cached_input) and completion (output) tokens"),
    PROPOSED_TOKENS: ("{token}", "draft tokens sent to verify"),
    ACCEPTED_TOKENS: ("{token}", "draft tokens the target accepted"),
    REJECTED_TOKENS: ("{token}", "draft tokens the target rejected (proposed - accepted)"),
    FALLBACKS: ("{step}", "sequence steps that decoded normally because the draft failed or was late"),
    ROUTES: ("{request}", "answered requests by bucket, pool, replica and reason"),
    ESCALATION_CANDIDATES: ("{request}", "requests run on a pool configured to escalate"),
    UPGRADES: ("{request}", "answers below the confidence threshold, discarded and escalated"),
    ROUTER_FALLBACKS: ("{request}", "requests escalated because their pool failed"),
    RETRIES: ("{request}", "requests retried on another replica before their first token"),
    DRAFT_SEQUENCES: ("{sequence}", "sequences proposed for, per pass, by method"),
    DRAFT_PROPOSED: ("{token}", "draft tokens proposed, by method"),
    CACHE_LOOKUPS: ("{lookup}", "cache lookups by kind (prefix, retrieval, tool) and result "
                                "(hit / miss / wait: waited on another caller's tool lease)"),
    PREFIX_MATCHED_BLOCKS: ("{block}", "leading blocks the best replica holds, summed over PrefixMatch calls"),
    SAVED_PREFILL_TOKENS: ("{token}", "prompt tokens served from the prefix cache, by cache kind "
                                      "(retrieval: retrieval-augmented requests)"),
}

# Observable gauges recorded outside the target's KV gauges (services/target/metrics.py):
# name -> (unit, description)
DRAFT_OPEN_SEQUENCES = "specmesh.draft.open_sequences"  # services/draft/open_sequences.py
GAUGES: dict[str, tuple[str, str]] = {
    DRAFT_OPEN_SEQUENCES: ("{sequence}", "sequences the draft holds state for (a lost Release leaves "
                                         "one behind; at max_sequences new ones are refused)"),
}

VIEWS = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(list(bounds)))
         for name, (_, bounds, _) in HISTOGRAMS.items()]

def method_name(method: int) -> str:
    """'prompt_lookup' for common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP; 'off' for none;
    'unknown' for a number the enum does not declare (never raises: it runs in metric calls)."""
    from specmesh.proto.v1 import common_pb2
    if method in (common_pb2.SPECULATION_METHOD_UNSPECIFIED, common_pb2.SPECULATION_METHOD_OFF):
        return "off"
    if method not in common_pb2.SpeculationMethod.values():
        return "unknown"
    return common_pb2.SpeculationMethod.Name(method).removeprefix("SPECULATION_METHOD_").lower()


def prometheus_names(extra: dict[str, tuple[str, str]] | None = None) -> set[str]:
    """Every sample name the Prometheus endpoints can expose for the catalogue (and `extra`:
    {otel name: (unit, "gauge" | "counter")}, e.g. the target's KV gauges), spelled as the
    OpenTelemetry Prometheus exporter spells them. The dashboard test checks its queries
    against this set."""
    names: set[str] = set()
    for name, (unit, _, _) in HISTOGRAMS.items():
        base = _prometheus_base(name, unit)
        names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    for name, (unit, _) in COUNTERS.items():
        names.add(_prometheus_base(name, unit) + "_total")
    for name, (unit, _) in GAUGES.items():
        names.add(_prometheus_base(name, unit))
    for name, (unit, kind) in (extra or {}).items():
        names.add(_prometheus_base(name, unit) + ("_total" if kind == "counter" else ""))
    return names


_UNIT_SUFFIXES = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": ""}


def _prometheus_base(name: str, unit: str) -> str:
    base = name.replace(".", "_")
    suffix = "" if unit.startswith("{") else _UNIT_SUFFIXES.get(unit, unit)
    if suffix and not base.endswith(f"_{suffix}"):
        base += f"_{suffix}"
    return base
