"""Numbered log of prefix-cache events, for subscribers that build a prefix index.

Each event gets the next sequence number. A subscriber passes the last number it saw;
when that is older than what the log still holds, it has a gap and must take a
snapshot (the full list of cached blocks) before following the log again.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from services.target.engine.block_manager import KVEvent


class KVEventLog:
    def __init__(self, capacity: int = 65536) -> None:
        self._lock = threading.Lock()
        self._events: deque[tuple[int, KVEvent]] = deque(maxlen=capacity)
        self._last = 0  # sequence number of the newest event (0 = none yet)
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def last_sequence(self) -> int:
        with self._lock:
            return self._last

    def append(self, events: list[KVEvent]) -> None:
        if not events:
            return
        with self._lock:
            for event in events:
                self._last += 1
                self._events.append((self._last, event))
            waiters = list(self._waiters)
        for loop, flag in waiters:
            loop.call_soon_threadsafe(flag.set)

    def since(self, after: int) -> list[tuple[int, KVEvent]] | None:
        """Events numbered > `after`, or None when some of them are gone (a gap)."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._last + 1
            if after + 1 < oldest and after < self._last:
                return None
            return [(n, e) for n, e in self._events if n > after]

    async def wait(self, after: int, timeout: float) -> None:
        """Waits until an event numbered > `after` exists, or `timeout` seconds pass."""
        flag = asyncio.Event()
        waiter = (asyncio.get_running_loop(), flag)
        with self._lock:
            if self._last > after:
                return
            self._waiters.add(waiter)
        try:
            await asyncio.wait_for(flag.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.discard(waiter)
