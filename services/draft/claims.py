"""Which sequences a request in flight is working on.

A request (Propose, a ProposeStream message, Release) claims its sequence ids and waits
until no other request holds any of them, so one sequence's state (its history, its
proposer's KV) is changed by one request at a time, while requests for other sequences
(other targets) run at once: their model forwards overlap in worker threads. Claims are
taken and dropped on the event loop without awaiting in between, so a claim is never lost
to a cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from contextlib import asynccontextmanager


class SequenceClaims:
    def __init__(self) -> None:
        self._held: dict[str, asyncio.Future] = {}  # sequence id -> done when its holder finishes

    def holds(self, sequence_id: str) -> bool:
        return sequence_id in self._held

    @asynccontextmanager
    async def hold(self, sequence_ids: Iterable[str]):
        ids = set(sequence_ids)
        while busy := {self._held[i] for i in ids if i in self._held}:
            await asyncio.wait(busy)
        done = asyncio.get_running_loop().create_future()
        self._held.update(dict.fromkeys(ids, done))
        try:
            yield
        finally:
            for i in ids:
                del self._held[i]
            done.set_result(None)
