"""The router's own health follows its targets: NOT_SERVING while no replica of any pool
is healthy (as the routing's health polls see them), SERVING again when one is back.

A load balancer in front of several routers then sends callers to a router that can
serve them, instead of one that would answer every call with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class TargetHealthWatch:
    def __init__(self, any_healthy: Callable[[], bool], interval_s: float) -> None:
        self._any_healthy = any_healthy
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None

    async def start(self, server) -> None:
        """Starts following; `server` is the router's GrpcServer (its `set_serving`)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(server))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self, server) -> None:
        serving = True  # the server starts SERVING
        while True:
            try:
                healthy = self._any_healthy()
                if healthy != serving:
                    log.warning("router %s: %s", "SERVING again" if healthy else "NOT_SERVING",
                                "a target is reachable" if healthy else "no target is reachable")
                    await server.set_serving(healthy)
                    serving = healthy
            except Exception:  # never let the watch die
                log.exception("target health watch failed")
            await asyncio.sleep(self._interval_s)
