"""Items handed from the engine's thread to the server's event loop, one wake-up per burst.

The engine emits one output per running sequence per step. Scheduling each on the loop with
`call_soon_threadsafe` writes to the loop's self-pipe once per output: at 18 sequences that was
3.6% of the target's samples in the 18-request batch (benchmarks/mesh_batch_profile.py), and
each write can wake the loop to run one callback. The mailbox keeps the items of a burst in
order and schedules one callback for all of them; a post made while that callback already
runs schedules the next one, so no item waits for a later burst.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque = deque()  # (asyncio.Queue, item), in posting order
        self._scheduled = False
        self.wakeups = 0  # callbacks scheduled on the loop (for tests and diagnostics)

    def post(self, queue: asyncio.Queue, item) -> None:
        """From any thread: `queue.put_nowait(item)` on the loop, after every item posted before."""
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # on the loop
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)


_mailboxes: dict[asyncio.AbstractEventLoop, LoopMailbox] = {}
_mailboxes_lock = threading.Lock()


def mailbox_for(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The loop's one mailbox (created on first use; a closed loop's is dropped then)."""
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            for old in [lp for lp in _mailboxes if lp.is_closed()]:
                del _mailboxes[old]
            box = _mailboxes[loop] = LoopMailbox(loop)
        return box
