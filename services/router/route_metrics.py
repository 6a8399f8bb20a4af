"""Router metrics: route distribution, escalation (upgrade) and fallback rates per bucket.

- `specmesh.router.routes` {bucket, pool, replica, reason, speculation.method}: where answers
  came from, and the speculation method their plan ran ("off" when none).
- `specmesh.router.escalation_candidates` {bucket, pool}: requests run on a pool that may
  escalate (the denominator of both rates).
- `specmesh.router.upgrades` {bucket, pool, to}: low confidence, answer discarded, escalated.
- `specmesh.router.fallbacks` {bucket, pool, to}: the pool failed (UNAVAILABLE /
  RESOURCE_EXHAUSTED), escalated.
- `specmesh.router.retries` {pool}: requests retried on another replica before the first token.
Upgrade rate = upgrades / escalation_candidates, per bucket (fallback rate likewise).
"""

from __future__ import annotations

import threading
from collections import Counter

from opentelemetry import metrics

ROUTES = "specmesh.router.routes"
CANDIDATES = "specmesh.router.escalation_candidates"
UPGRADES = "specmesh.router.upgrades"
FALLBACKS = "specmesh.router.fallbacks"
RETRIES = "specmesh.router.retries"
_DESCRIPTIONS = {
    ROUTES: "answered requests by bucket, pool, replica, reason and speculation method",
    CANDIDATES: "requests run on a pool configured to escalate",
    UPGRADES: "answers below the confidence threshold, discarded and escalated",
    FALLBACKS: "requests escalated because their pool failed",
    RETRIES: "requests retried on another replica before their first token",
}
_lock = threading.Lock()
_counters: dict[str, object] = {}
_tally: Counter = Counter()  # (name, attributes) -> count, for `count` (this process)


def add(name: str, attributes: dict[str, str]) -> None:
    with _lock:
        counter = _counters.get(name)
        if counter is None:
            counter = _counters[name] = _meter().create_counter(
                name, unit="{request}", description=_DESCRIPTIONS[name])
        _tally[(name, tuple(sorted(attributes.items())))] += 1
    counter.add(1, attributes)


def count(name: str, **attributes: str) -> int:
    """How many `name` events with (at least) these attributes this process recorded."""
    with _lock:
        return sum(n for (metric, attrs), n in _tally.items()
                   if metric == name and attributes.items() <= dict(attrs).items())


def _meter():
    try:  # the router's own meter provider where telemetry has one per service
        from services.common.telemetry import meter
        return meter("router")
    except ImportError:
        return metrics.get_meter("specmesh.router")
