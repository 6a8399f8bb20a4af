"""Builds and loads specmesh's CPU kernel module, `specmesh_cpu_kernels`, on first use.

It holds the AVX-512 bf16 linear kernel (cpu_linear.cpp, wrapped in cpu_linear.py), Gemma 3's
per-row ops (cpu_rowops.cpp) and the paged bf16 attention of decode rows and prefill chunks
(cpu_decode_attention.cpp, cpu_chunk_attention.cpp), all wrapped in cpu_rowops.py; the
prototypes are in cpu_kernels.h, the Python bindings in cpu_kernels.cpp.

The module is compiled with torch's own extension builder (`torch.utils.cpp_extension.load`,
ninja and the system C++ compiler) into torch's extension cache, keyed by the source, so a
machine compiles it once (~1 minute; `scripts/setup.sh` does it ahead of time). Where it cannot
be built or the CPU lacks AVX-512, `available()` says why and the engine keeps oneDNN.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

MODULE_NAME = "specmesh_cpu_kernels"
SOURCES = [str(Path(__file__).with_name(name)) for name in (
    "cpu_kernels.cpp", "cpu_linear.cpp", "cpu_rowops.cpp", "cpu_decode_attention.cpp",
    "cpu_chunk_attention.cpp")]
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-fopenmp"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere); read once per process."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def bf16_dot_instruction() -> bool:
    """Whether the kernels can multiply with VDPBF16PS (AVX512-BF16) here."""
    return avx512() and "avx512_bf16" in cpu_flags()


def avx512() -> bool:
    flags = cpu_flags()
    return platform.machine() in ("x86_64", "AMD64") and {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags


@functools.cache
def module():
    """The loaded extension module (built first if torch's cache has no build of these sources)."""
    from torch.utils.cpp_extension import load

    return load(name=MODULE_NAME, sources=SOURCES, extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                verbose=os.environ.get("SPECMESH_VERBOSE_BUILD") == "1")


@functools.cache
def unavailable_reason() -> str | None:
    """None if the module runs here, else why not (what a user can do about it)."""
    if not avx512():
        return "the CPU has no AVX-512 (avx512f/bw/dq/vl)"
    try:
        module()
    except Exception as exc:  # a missing compiler or ninja: report it, keep serving with oneDNN
        return f"the kernel did not build ({type(exc).__name__}: {exc}); install ninja and a C++ compiler"
    return None


def available() -> bool:
    return unavailable_reason() is None


if __name__ == "__main__":  # scripts/setup.sh and the image: build before the first engine start
    # Never without AVX-512: loading the built module there could execute AVX-512 code and
    # crash; the engine then builds it on first use on an AVX-512 machine (the image has g++).
    if avx512():
        print("building specmesh's AVX-512 CPU kernels (once, about a minute)...", flush=True)
        module()
    reason = unavailable_reason()
    print("AVX-512 CPU kernels: " + ("ready" if reason is None else f"not used here: {reason}"))
