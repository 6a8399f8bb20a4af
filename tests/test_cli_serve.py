"""Each `specmesh serve SERVICE` that compose.yaml names starts without Docker, answers
health SERVING and exits cleanly on SIGTERM (the target is covered by tests/test_cli_up.py)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from services.common.healthcheck import check


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("service", ["router", "draft", "cache"])
def test_serve_starts_answers_health_and_stops_on_sigterm(service):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", service, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if check(f"127.0.0.1:{port}", timeout=1.0) == "SERVING":
                    break
            except Exception:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, f"{service} did not become SERVING"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
