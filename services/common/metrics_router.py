"""The router's per-request metrics: what the caller sees (TTFT, TPOT, end to end), requests
by status, token usage — per bucket, pool and speculation method. (Route distribution and
upgrade rate: services/router/route_metrics.py.)

    timer = RequestTimer(bucket, pool, method)           # after routing
    timer.chunk(num_tokens)                              # per streamed chunk
    timer.finish("OK", usage)                            # once, with the gRPC status name
"""

from __future__ import annotations

import time

from services.common import metrics as m
from services.common.instruments import counter, histogram

SERVICE = "router"


class RequestTimer:
    def __init__(self, bucket: str, pool: str, method: str, start: float | None = None) -> None:
        self.attributes = {"specmesh.bucket": bucket, "specmesh.pool": pool,
                           "specmesh.speculation.method": method}
        self.start = time.monotonic() if start is None else start
        self._last: float | None = None
        self._tokens = 0
        self._finished = False

    def chunk(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            histogram(SERVICE, m.TTFT).record(now - self.start, self.attributes)
        else:
            histogram(SERVICE, m.TPOT).record((now - self._last) / num_tokens, self.attributes)
        self._last = now
        self._tokens += num_tokens

    def finish(self, status: str, usage=None) -> None:
        """`status`: a grpc.StatusCode name; `usage`: the final chunk's common_pb2.Usage."""
        if self._finished:
            return
        self._finished = True
        counter(SERVICE, m.REQUESTS).add(1, {**self.attributes, "specmesh.status": status})
        if status != "OK":
            return
        histogram(SERVICE, m.E2E).record(time.monotonic() - self.start, self.attributes)
        if usage is not None:
            tokens = counter(SERVICE, m.TOKENS)
            tokens.add(usage.prompt_tokens, {**self.attributes, "gen_ai.token.type": "input"})
            tokens.add(usage.cached_prompt_tokens, {**self.attributes, "gen_ai.token.type": "cached_input"})
            tokens.add(usage.completion_tokens, {**self.attributes, "gen_ai.token.type": "output"})

