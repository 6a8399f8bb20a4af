"""Per-tenant quotas at the router: requests in flight and tokens per second.

Each tenant of the mesh config may have `max_concurrent` (requests in flight) and
`tokens_per_second` (a token bucket of `burst_tokens`, charged prompt + max_tokens when a
request is admitted). Over either limit the request is refused before any work with
`QuotaExceeded`, carrying how long to wait (`retry_after_ms`, sent as the standard
`grpc-retry-pushback-ms` trailer); other tenants are not affected. Event-loop only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.mesh_config import TenantConfig

CONCURRENCY_PUSHBACK_MS = 100  # a slot frees when any in-flight request ends; check again soon


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


@dataclass
class _Bucket:
    tokens: float
    updated: float


class TenantQuotas:
    def __init__(self, tenants: tuple[TenantConfig, ...], clock: Callable[[], float] = time.monotonic) -> None:
        self._tenants = {t.name: t for t in tenants}
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    def acquire(self, tenant: str, tokens: int) -> Callable[[], None]:
        """Admits one request of `tokens` (prompt + max_tokens); returns its release function."""
        config = self._tenants.get(tenant)
        if config is None:
            return _noop
        in_flight = self._in_flight.get(tenant, 0)
        if config.max_concurrent and in_flight >= config.max_concurrent:
            raise QuotaExceeded(f"tenant quota: {in_flight} requests in flight, limit "
                                f"{config.max_concurrent}; retry later", CONCURRENCY_PUSHBACK_MS)
        if config.tokens_per_second:
            bucket = self._refill(config)
            need = min(tokens, self._capacity(config))  # a request above the burst waits for a full
            if bucket.tokens < need:                    # bucket, then leaves it in debt
                wait = (need - bucket.tokens) / config.tokens_per_second
                raise QuotaExceeded(f"tenant quota: {config.tokens_per_second:g} tokens/s exceeded "
                                    f"({tokens} asked, {bucket.tokens:.0f} available); retry later",
                                    max(1, int(wait * 1000 + 0.999)))
            bucket.tokens -= tokens
        self._in_flight[tenant] = in_flight + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._in_flight[tenant] -= 1
        return release

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def _refill(self, config: TenantConfig) -> _Bucket:
        now = self._clock()
        capacity = self._capacity(config)
        bucket = self._buckets.setdefault(config.name, _Bucket(capacity, now))
        bucket.tokens = min(capacity, bucket.tokens + (now - bucket.updated) * config.tokens_per_second)
        bucket.updated = now
        return bucket

    @staticmethod
    def _capacity(config: TenantConfig) -> float:
        return float(config.burst_tokens or 2 * config.tokens_per_second)


def _noop() -> None:
    pass
