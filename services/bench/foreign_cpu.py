"""CPU used by processes outside the system under test, while a benchmark measures.

A 2-core machine shared with anything else skews every ratio (a busy-polling server loses
more to other load than one that sleeps), so a measurement must say how much CPU others
used while it ran, and be void above a bound. `ForeignCpu` samples, every `interval_s`,
the machine's busy CPU time (/proc/stat) and the CPU time of the processes under test
(/proc/<pid>/stat of the given roots and all their descendants); the difference, over the
machine's capacity in that interval, is the foreign share of that sample.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")
VOID_SHARE = 0.05  # a measurement with more foreign CPU than this is void


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICKS


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def process_tree(roots: Iterable[int]) -> set[int]:
    """The roots and every process descended from them."""
    tree, found, todo = _children(), set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(tree.get(pid, ()))
    return found


def process_seconds(pid: int) -> float:
    """CPU seconds (user + system) of one process, all its threads; 0 once it has ended."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


class ForeignCpu:
    """Samples the foreign CPU share in a background thread (`with ForeignCpu() as cpu:`).

    `roots()`: pids of the systems under test (default: this process); their descendants are
    theirs too. A process of ours that ends between two samples takes its last interval's
    CPU with it, which then counts as foreign: an over-, never an under-estimate.
    """

    def __init__(self, roots: Callable[[], Iterable[int]] | None = None, interval_s: float = 1.0) -> None:
        self.roots = roots or (lambda: [os.getpid()])
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []  # (monotonic end of the interval, foreign share)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ours: dict[int, float] = {}

    def __enter__(self) -> "ForeignCpu":
        self._thread = threading.Thread(target=self._run, name="foreign-cpu", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _our_seconds(self) -> dict[int, float]:
        return {pid: process_seconds(pid) for pid in process_tree(self.roots())}

    def _run(self) -> None:
        cores = os.cpu_count() or 1
        busy, ours, at = machine_busy_seconds(), self._our_seconds(), time.monotonic()
        while not self._stop.wait(self.interval_s):
            busy2, ours2, at2 = machine_busy_seconds(), self._our_seconds(), time.monotonic()
            # Our CPU in the interval: per process, so a new process counts from its start.
            mine = sum(max(s - ours.get(pid, 0.0), 0.0) for pid, s in ours2.items())
            foreign = max(busy2 - busy - mine, 0.0) / max((at2 - at) * cores, 1e-9)
            self.samples.append((at2, foreign))  # not clipped: a mean over samples stays right
            busy, ours, at = busy2, ours2, at2

    def share(self, start: float = float("-inf"), end: float = float("inf")) -> dict:
        """Median, mean and max foreign share of the samples that ended within [start, end]
        (monotonic), and whether that stretch is void (median above VOID_SHARE)."""
        values = sorted(v for t, v in self.samples if start <= t <= end)
        if not values:
            return {"median": None, "mean": None, "max": None, "samples": 0, "void": False}
        median = values[len(values) // 2]
        return {"median": median, "mean": sum(values) / len(values), "max": values[-1],
                "samples": len(values), "void": median > VOID_SHARE}
