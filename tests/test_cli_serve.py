"""Each `specmesh serve SERVICE` that compose.yaml names starts without Docker, answers
health SERVING and exits cleanly on SIGTERM (the target is covered by tests/test_cli_up.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.processes import free_port, wait_until_serving


@pytest.mark.parametrize("service", ["router", "draft", "cache"])
def test_serve_starts_answers_health_and_stops_on_sigterm(service):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", service, "--port", str(port), "--dev"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(proc, [f"127.0.0.1:{port}"], timeout_s=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
