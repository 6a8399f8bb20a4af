"""Items handed from the engine's thread to the server's event loop, one wake-up per step.

The engine emits one output per running sequence per step. Scheduling each on the loop with
`call_soon_threadsafe` writes to the loop's self-pipe once per output: at 18 sequences that was
3.6% of the target's samples in the 18-request batch (benchmarks/mesh_batch_profile.py), and
each write wakes the loop (on the other core) to run one callback. The mailbox keeps posted
items in order and schedules one callback for all that wait; while a thread is inside `held()`
(the engine, emitting a step's outputs) its posts only queue, and leaving schedules each
mailbox it posted to once. A post made while a delivery already runs schedules the next one,
so no item waits for a later step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque

_held = threading.local()  # .mailboxes: the set a thread inside held() posted to


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
        pending = getattr(_held, "mailboxes", None)
        if pending is not None:
            pending.add(self)
        else:
            self._schedule()

    def _schedule(self) -> None:
        with self._lock:
            if self._scheduled or not self._items:
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


@contextlib.contextmanager
def held():
    """Posts made on this thread inside the block reach their loops when it ends, one wake-up each."""
    outer = getattr(_held, "mailboxes", None)
    if outer is not None:  # nested: the outermost block delivers
        yield
        return
    _held.mailboxes = set()
    try:
        yield
    finally:
        boxes, _held.mailboxes = _held.mailboxes, None
        for box in boxes:
            box._schedule()


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
