"""Large step buffers come from glibc's heap instead of fresh mappings
(services/common/large_allocations.py, called by Engine.load): with the call a 64 MB buffer is
not among malloc's mmapped bytes (mallinfo2's hblkhd), without it it is. Checked in malloc's
own accounting, not in time or page faults (this VM's DAMON reclaim makes fault counts vary)."""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD = """
import ctypes, sys, torch
from services.common.large_allocations import keep_large_allocations_on_heap

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "heap":
    assert keep_large_allocations_on_heap()
before = libc.mallinfo2().hblkhd
x = torch.ones(16 << 20)  # 64 MB, as a step's float32 logits of 64 sampled rows
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, "SPECMESH_HEAP_LARGE_ALLOCATIONS": "1"})
    return int(out.stdout.strip().splitlines()[-1])


def test_a_large_step_buffer_comes_from_the_heap_not_a_fresh_mapping():
    assert _mapped_bytes("mmap") >= 64 << 20  # glibc's default: its own mapping, unmapped on free
    assert _mapped_bytes("heap") == 0


def test_the_switch_turns_it_off(monkeypatch):
    import services.common.large_allocations as large
    monkeypatch.setattr(large, "_applied", False)
    monkeypatch.setenv("SPECMESH_HEAP_LARGE_ALLOCATIONS", "0")
    assert large.keep_large_allocations_on_heap() is False
