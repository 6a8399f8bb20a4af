"""`specmesh up` as a subprocess: four services SERVING, `specmesh generate` prints text."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.env import read_settings
from services.common.healthcheck import check
from services.common.models.prepare import prepare_default_model

pytestmark = pytest.mark.slow


def _free_base_port() -> int:
    """A port p such that p..p+3 are all free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 3 < 65535 and all(_free(base + i) for i in range(4)):
            return base
    raise RuntimeError("no four consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_up_serves_all_four_and_generate_prints_text():
    settings = read_settings()
    prepare_default_model(Path(settings.model_cache).expanduser() / "gemma-3-270m", progress=False)
    base = _free_base_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--base-port", str(base)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        addresses = [f"127.0.0.1:{base + i}" for i in range(4)]
        while True:
            try:
                if all(check(a, timeout=1.0) == "SERVING" for a in addresses):
                    break
            except Exception:
                pass
            assert up.poll() is None, f"specmesh up exited:\n{up.stdout.read()}"
            assert time.monotonic() < deadline, "services did not become SERVING"
            time.sleep(0.5)
        gen = subprocess.run([sys.executable, "-m", "services.cli", "generate", "The capital of France is",
                              "--address", addresses[0], "--max-tokens", "12"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.strip(), "no text streamed"
        assert "time to first token" in gen.stderr and "tokens/s" in gen.stderr
    finally:
        up.send_signal(signal.SIGINT)
        try:
            out, _ = up.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            out, _ = up.communicate()
    assert up.returncode == 0, out
