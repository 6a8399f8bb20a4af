"""specmesh's CPU kernels run without Python's GIL: while the engine thread is inside a kernel, the
process's other Python threads (the target's gRPC handlers streaming tokens, the draft client's
reader) run beside it instead of waiting for the engine thread's next bytecode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One long kernel call on the main thread while a second thread records when it gets to run; prints
# the call's length and the longest stretch inside it in which the second thread never ran.
PROBE = r"""
import json, threading, time
import torch
from services.target.kernels import cpu_linear

torch.manual_seed(0)
x = torch.randn(2048, 2048).to(torch.bfloat16)
w = cpu_linear.pack(torch.randn(8192, 2048).to(torch.bfloat16))
kernel = cpu_linear.bf16_linear
kernel(x[:8], w, 8192)  # warm
beats, stop = [], threading.Event()

def beat():
    while not stop.is_set():
        beats.append(time.perf_counter())

thread = threading.Thread(target=beat)
thread.start()
time.sleep(0.05)
start = time.perf_counter()
kernel(x, w, 8192)
end = time.perf_counter()
stop.set()
thread.join()
inside = [start] + [t for t in beats if start < t < end] + [end]
print(json.dumps({"call": end - start, "longest_gap": max(b - a for a, b in zip(inside, inside[1:]))}))
"""


def probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_another_python_thread_runs_while_a_kernel_runs():
    released = probe()
    # Without the GIL the other thread runs throughout the call (its gaps are the OS's time slices).
    assert released["longest_gap"] < 0.5 * released["call"], released
    # The same probe with the GIL held through kernels (SPECMESH_KERNELS_HOLD_GIL=1): the other
    # thread waits out the whole call, so the check above tells the two apart.
    held = probe(SPECMESH_KERNELS_HOLD_GIL="1")
    assert held["longest_gap"] > 0.75 * held["call"], held
