"""`specmesh up` as a subprocess: four services SERVING, `specmesh generate` prints text."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.settings import read_settings
from services.common.healthcheck import check
from services.common.models.prepare import prepare_default_model
from tests.processes import free_port_run, wait_until_serving

pytestmark = pytest.mark.slow


def test_up_serves_all_four_and_generate_prints_text():
    settings = read_settings()
    prepare_default_model(Path(settings.model_cache).expanduser() / "gemma-3-270m", progress=False)
    base = free_port_run(4)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--base-port", str(base),
                           "--gateway-port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        addresses = [f"127.0.0.1:{base + i}" for i in range(4)]
        wait_until_serving(up, addresses[:1], timeout_s=180)  # the router starts last
        for internal in addresses[1:]:  # mutual TLS with this run's certificates: plaintext is refused
            with pytest.raises(grpc.RpcError) as info:
                check(internal, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
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
    certs = re.search(r"mesh certificates for this run in (\S+) \(removed at exit\)", out).group(1)
    assert not Path(certs).exists()
