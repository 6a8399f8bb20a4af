"""The CLI says what to do when something is wrong."""

from __future__ import annotations

import subprocess
import sys

from tests.processes import free_port


def test_generate_without_a_router_exits_1_with_a_hint():
    port = free_port()
    result = subprocess.run([sys.executable, "-m", "services.cli", "generate", "hi", "--address",
                             f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr and "specmesh up" in result.stderr


def test_bad_setting_exits_2_naming_the_variable():
    env = {"SPECMESH_NUM_BLOCKS": "many", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "services.cli", "generate", "hi"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert "SPECMESH_NUM_BLOCKS" in result.stderr
