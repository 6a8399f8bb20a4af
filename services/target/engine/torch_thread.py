"""The one thread that runs all of an engine's torch work.

Why one thread: every thread that runs torch ops gets its own OpenMP worker team, and two
teams on few cores slow each other's matmuls down (measured here: one bf16 linear took
86 us on a single team, 137 us once a second team existed). A daemon thread, so that an
engine nobody shut down never keeps the process from exiting.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class TorchThread:
    def __init__(self, name: str = "specmesh-engine") -> None:
        self._tasks: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._tasks.put((fn, args, future))
        return future

    def shutdown(self, timeout: float | None = None) -> None:
        """Stops after the tasks already queued; waits up to `timeout` seconds (None: no wait)
        for the thread to end."""
        self._tasks.put(None)
        if timeout is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, args, future = task
            run_task(fn, args, future)


def run_task(fn, args, future: Future) -> None:
    """Runs fn(*args) and hands its result or exception to `future`."""
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # handed to the caller
        future.set_exception(exc)
