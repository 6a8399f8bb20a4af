"""Releases lost while the draft hangs are retried on their own timer: after a 6 s SIGSTOP of
the draft process with speculating streams in flight, and an idle target afterwards, the
draft's open sequences return to 0 within 10 s of SIGCONT. Real processes, mutual TLS."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from services.common.healthcheck import check
from services.common.tls import MeshTls, make_dev_certs
from tests.mesh import collect, request, start_mesh
from tests.processes import free_port

pytestmark = pytest.mark.slow
_OPEN = re.compile(r"^specmesh_draft_open_sequences(?:\{[^}]*\})? (\S+)$", re.M)


def _open_sequences(metrics_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        return int(float(_OPEN.search(response.read().decode()).group(1)))


async def test_open_sequences_return_to_zero_after_a_draft_hang_with_the_target_idle(tiny_llama_dir, tmp_path):
    certs = make_dev_certs(tmp_path / "certs")
    port, metrics_port = free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")}, "PYTHONUNBUFFERED": "1"}
    draft = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "draft", "--port", str(port),
                              "--tls-dir", str(certs), "--metrics-port", str(metrics_port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    mesh = None
    try:
        tls = MeshTls.from_dir(certs, "draft")
        for _ in range(300):
            try:
                if await asyncio.to_thread(check, f"127.0.0.1:{port}", timeout=1.0, tls=tls) == "SERVING":
                    break
            except Exception:
                await asyncio.sleep(0.2)
        mesh = await start_mesh(tiny_llama_dir, tls_dir=certs, draft_address=f"127.0.0.1:{port}",
                                draft_timeout_s=0.5,
                                speculation={"speculation_method": "prompt_lookup", "speculation_depth": 4})
        prompt = "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4"
        warm = await collect(mesh.router_stub, request(prompt, 16))
        assert warm[2].usage.proposed_tokens > 0  # the draft answers
        streams = [asyncio.create_task(collect(mesh.router_stub, request(f"{prompt} {i}", 120)))
                   for i in range(4)]
        while _open_sequences(metrics_port) < 4:  # all four are speculating
            await asyncio.sleep(0.05)
        draft.send_signal(signal.SIGSTOP)
        await asyncio.sleep(6.0)
        results = await asyncio.gather(*streams)  # they finish without the draft (fallback)
        assert all(len(ids) == 120 for ids, _, _ in results)
        draft.send_signal(signal.SIGCONT)
        resumed = time.monotonic()  # the target stays idle from here on
        while (count := _open_sequences(metrics_port)) != 0:
            assert time.monotonic() - resumed < 10.0, f"{count} draft sequences still open 10 s after SIGCONT"
            await asyncio.sleep(0.2)
        assert mesh.engine.speculator.client.num_unreleased == 0
    finally:
        if mesh is not None:
            await mesh.stop()
        draft.send_signal(signal.SIGCONT)
        draft.terminate()
        draft.wait(timeout=30)
