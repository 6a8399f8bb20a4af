"""Ports and subprocess helpers for tests that start specmesh the way a user does."""

from __future__ import annotations

import socket
import subprocess
import time

from services.common.healthcheck import check


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int) -> int:
    """A port p such that p .. p + count - 1 are all free right now."""
    for _ in range(50):
        base = free_port()
        if base + count < 65535 and all(_is_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def wait_until_serving(proc: subprocess.Popen, addresses: list[str], timeout_s: float) -> None:
    """Polls health until every address answers SERVING; fails if the process exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if all(check(a, timeout=1.0) == "SERVING" for a in addresses):
                return
        except Exception:
            pass  # not listening yet
        assert proc.poll() is None, f"the process exited:\n{proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, f"{addresses} did not become SERVING in {timeout_s} s"
        time.sleep(0.2)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
