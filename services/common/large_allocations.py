"""Large buffers reused from the heap instead of mapped afresh every step (glibc only).

glibc's malloc serves a request above its mmap threshold (at most 32 MB, dynamically) with a
fresh mmap and gives it back with munmap on free, so the kernel faults in and zeroes every page
again the next time. An engine step allocates such buffers every step: a sampled row's logits
are 1 MB in float32, so 64 sampled rows make 67 MB for the float copy and as much for the
softmax. Measured on a 2-core AMD EPYC: converting and softmaxing [64, 262144] bf16 logits took
77 ms a step with fresh mappings and 12-15 ms with the heap reused (one thread, 20 steps).
vLLM's CPU guide preloads tcmalloc for the same reason; this keeps glibc and raises its
thresholds instead (with tcmalloc or jemalloc preloaded the call changes nothing). The price:
the process keeps the peak of its large buffers resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # requests below this come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept before giving it back (both fit a C int)
_applied = False


def keep_large_allocations_on_heap() -> bool:
    """Raises glibc's mmap and trim thresholds once per process; False where there is no glibc
    `mallopt` or SPECMESH_HEAP_LARGE_ALLOCATIONS=0."""
    global _applied
    if _applied:
        return True
    if os.environ.get("SPECMESH_HEAP_LARGE_ALLOCATIONS", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _applied:
        log.warning("mallopt refused the mmap/trim thresholds: large step buffers are mapped afresh each step")
    return _applied
