"""`specmesh status` against a running `specmesh up` (tiny model): every service SERVING and
the replica's KV numbers and host-tier precision; one-line errors for a taken port and a missing model; --version;
help text on every flag."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

from services.cli import _parser
from services.common.models.tiny import build_tiny_model
from specmesh import __version__
from tests.processes import free_port, free_port_run, wait_until_serving

CLI = [sys.executable, "-m", "services.cli"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", arch="llama", seed=0)
    base, gateway = free_port_run(4), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen([*CLI, "up", "--dev", "--model", str(model_dir), "--port", str(base),
                           "--gateway-port", str(gateway), "--metrics-base-port", "0", "--dtype", "float32",
                           "--num-blocks", "64", "--kv-host-bytes", str(3 << 19)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_until_serving(up, [f"127.0.0.1:{base + i}" for i in (0, 2, 3)], timeout_s=180)
        yield base, gateway, model_dir
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.communicate()


def test_status_lists_every_service_serving_and_the_replicas_kv(mesh):
    base, gateway, _ = mesh
    argv = [*CLI, "status", "--port", str(base), "--gateway-port", str(gateway), "--dev"]
    for _ in range(100):  # until the router has polled the replica's stats once
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if (result.returncode == 0 and "no stats yet" not in result.stdout
                and "1/1 target replicas synced" in result.stdout):  # the cache follows the target
            break
        time.sleep(0.2)
    assert result.returncode == 0, result.stdout + result.stderr
    host = "127.0.0.1"
    width = len(f"http://{host}:{gateway}")
    lines = result.stdout.splitlines()
    cache_line = lines.pop(5)  # the cache instance's own stats (numbers: whatever KV the target holds)
    assert cache_line.startswith(f"cache {host}:{base + 3}  prefix index: 1/1 target replicas synced, ")
    assert cache_line.endswith("snapshots  backend memory")
    assert lines == [
        f"{'service':<8} {'address':<{width}}  state",
        f"{'router':<8} {f'{host}:{base}':<{width}}  SERVING",
        f"{'draft':<8} {f'{host}:{base + 2}':<{width}}  SERVING",
        f"{'cache':<8} {f'{host}:{base + 3}':<{width}}  SERVING",
        f"{'gateway':<8} {f'http://{host}:{gateway}':<{width}}  ok",
        "pool default (model " + result.stdout.split("pool default (model ")[1].split(")")[0] + ")",
        f"  replica {host}:{base + 1}  SERVING  KV 0/64 blocks used, 0 cached, 64 free  "
        "host tier 0.0/1.5 MiB, 0 blocks restored  running 0  "
        "waiting 0  queued tokens 0",
        "    cold KV precision auto -> off (no measured accuracy cost for this model and pool dtype), "
        "host tier holds 0 FP8 blocks (0.0 MiB)",
    ]


def test_a_taken_port_and_a_missing_model_are_one_line_errors(mesh):
    base, _, model_dir = mesh
    taken = subprocess.run([*CLI, "serve", "cache", "--dev", "--port", str(base + 3), "--metrics-port", "0"],
                           capture_output=True, text=True, timeout=60)
    assert taken.returncode == 1
    assert taken.stderr == (f"specmesh: error: cannot listen on 127.0.0.1:{base + 3}: already in use "
                            "(another specmesh running? pick another --port)\n")
    missing = subprocess.run([*CLI, "serve", "target", "--dev", "--port", str(free_port()),
                              "--model", str(model_dir) + "-missing"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert len(missing.stderr.splitlines()) == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.startswith(f"specmesh: error: no model directory at '{model_dir}-missing'")


def test_version():
    result = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert result.stdout == f"specmesh {__version__}\n"


def test_every_flag_has_help():
    def walk(parser: argparse.ArgumentParser, path: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{path} {name}")
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                yield path, action
    missing = [f"{path} {a.option_strings or a.dest}" for path, a in walk(_parser(), "specmesh") if not a.help]
    assert missing == []


def test_serve_gateway_in_front_of_a_running_router(mesh):
    import json
    import urllib.request

    from tests.processes import free_port as port_now
    base, _, _ = mesh
    port = port_now()
    proc = subprocess.Popen([*CLI, "serve", "gateway", "--router-address", f"127.0.0.1:{base}",
                             "--gateway-port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                         headers={"Authorization": "Bearer specmesh-dev-token"})
        for _ in range(300):
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    models = json.loads(response.read())
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        assert [m["id"] for m in models["data"]] == ["default"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
