"""Items handed from the engine's thread to the server's event loop, one wake-up per step.

The engine emits one output per running sequence per step. Scheduling each on the loop with
`call_soon_threadsafe` writes to the loop's self-pipe once per output: at 18 sequences that was
3.6% of the target's samples in the 18-request batch (benchmarks/mesh_batch_profile.py), and
each write wakes the loop (on the other core) to run one callback. The mailbox keeps posted
items in order and schedules one callback for all that wait; while a thread is inside `held()`
(the engine, emitting a step's outputs) its posts only queue, and leaving schedules each
mailbox it posted to once. A post made while a delivery already runs schedules the next one,
so no item waits for a later step.

The wake-up itself is a write to an eventfd the loop reads (`add_reader`), made without releasing
the GIL (through `ctypes.PyDLL`). `call_soon_threadsafe` writes to the loop's self-pipe with
`socket.send`, which releases the GIL for the syscall: the loop's thread, woken by that very byte,
often took the GIL first, and the engine thread then waited for the loop's per-token work before it
could start its next step (5% of the engine thread's samples, single-stream through the mesh, py-spy,
2026-12-07). Holding the GIL, the engine goes on and the loop runs while the next step's kernels
run without it (cpu_kernels.cpp). Where eventfd or libc's write is missing, `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
from collections import deque

_held = threading.local()  # .mailboxes: the set a thread inside held() posted to


def _gil_holding_write():
    """libc's write(2) called without releasing the GIL, or None where it cannot be had."""
    if os.environ.get("SPECMESH_MAILBOX_WAKEUP", "eventfd") != "eventfd" or not hasattr(os, "eventfd"):
        return None
    try:
        write = ctypes.PyDLL(None).write  # PyDLL: the call keeps the GIL (CDLL would release it)
    except (OSError, AttributeError):
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    return write


_WRITE = _gil_holding_write()
_ONE = ctypes.c_uint64(1)  # an eventfd write adds this to its counter


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque = deque()  # (asyncio.Queue, item), in posting order
        self._scheduled = False
        self.wakeups = 0  # callbacks scheduled on the loop (for tests and diagnostics)
        self._fd = None  # the eventfd the loop reads (None: call_soon_threadsafe wakes it)
        if _WRITE is not None:
            self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            # registered on the loop's thread; a wake-up before that waits in the counter
            loop.call_soon_threadsafe(loop.add_reader, self._fd, self._on_wakeup)

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
        if self._fd is None or _WRITE(self._fd, ctypes.byref(_ONE), 8) != 8:
            self._loop.call_soon_threadsafe(self._deliver)

    def _on_wakeup(self) -> None:  # on the loop: the eventfd is readable
        try:
            os.eventfd_read(self._fd)  # resets the counter
        except BlockingIOError:
            pass
        self._deliver()

    def close(self) -> None:
        """Stops reading the eventfd and closes it (on the loop's thread, or after the loop closed)."""
        if self._fd is None:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = None

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
                _mailboxes.pop(old).close()
            box = _mailboxes[loop] = LoopMailbox(loop)
        return box
