"""Each `specmesh serve SERVICE` that compose.yaml names starts without Docker, answers
health and exits cleanly on SIGTERM (the target is covered by tests/tools/test_cli_up.py).

`--dev`: plaintext between services (no mesh certificates; tests/e2e/test_mtls.py covers TLS).
The router alone has no target behind it, so its health answers NOT_SERVING."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from services.common.healthcheck import check
from tests.processes import free_port, wait_until_serving


@pytest.mark.parametrize("service", ["router", "draft", "cache"])
def test_serve_starts_answers_health_and_stops_on_sigterm(service):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", service, "--port", str(port), "--dev"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if service == "router":
            assert _first_health_answer(proc, f"127.0.0.1:{port}", timeout_s=60) == "NOT_SERVING"
        else:
            wait_until_serving(proc, [f"127.0.0.1:{port}"], timeout_s=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def _first_health_answer(proc: subprocess.Popen, address: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check(address, timeout=1.0)
        except Exception:
            pass  # not listening yet
        assert proc.poll() is None, "the process exited"
        assert time.monotonic() < deadline, f"{address} did not answer health in {timeout_s} s"
        time.sleep(0.2)
