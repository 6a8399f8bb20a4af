"""Builds and loads the AVX-512 bf16 linear kernel (cpu_linear.cpp) on first use, with the
per-row ops between the matmuls, the decode rows' and the prefill chunks' attention
(cpu_rowops.cpp, cpu_decode_attention.cpp and cpu_chunk_attention.cpp, wrapped in
cpu_rowops.py) in the same module.

On a CPU with AVX512-BF16 the kernel multiplies with VDPBF16PS; on other AVX-512 CPUs it widens
bf16 to float32 and uses FMA (`bf16_linear(dot=...)`; the default is what the CPU has).

The kernel is compiled with torch's own extension builder (`torch.utils.cpp_extension.load`,
ninja and the system C++ compiler) into torch's extension cache, keyed by the source, so a
machine compiles it once (~1 minute; `scripts/setup.sh` does it ahead of time). Where it cannot
be built or the CPU lacks AVX-512, `available()` says why and the engine keeps oneDNN.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

_SOURCES = [str(Path(__file__).with_name(name)) for name in ("cpu_linear.cpp", "cpu_rowops.cpp",
                                                                      "cpu_decode_attention.cpp",
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
    """Whether the kernel can multiply with VDPBF16PS (AVX512-BF16) here."""
    return avx512() and "avx512_bf16" in cpu_flags()


def avx512() -> bool:
    flags = cpu_flags()
    return platform.machine() in ("x86_64", "AMD64") and {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags


@functools.cache
def _module():
    from torch.utils.cpp_extension import load

    return load(name="specmesh_cpu_linear", sources=_SOURCES, extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"], verbose=os.environ.get("SPECMESH_VERBOSE_BUILD") == "1")


@functools.cache
def unavailable_reason() -> str | None:
    """None if the kernel runs here, else why not (what a user can do about it)."""
    if not avx512():
        return "the CPU has no AVX-512 (avx512f/bw/dq/vl)"
    try:
        _module()
    except Exception as exc:  # a missing compiler or ninja: report it, keep serving with oneDNN
        return f"the kernel did not build ({type(exc).__name__}: {exc}); install ninja and a C++ compiler"
    return None


def available() -> bool:
    return unavailable_reason() is None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> its panels [ceil(N / 32), ceil(K / 2), 64] bf16, the layout `bf16_linear` reads."""
    return _module().pack_bf16_weight(weight)


def bf16_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, dot: bool | None = None) -> torch.Tensor:
    """x [M, K] bf16 times the packed weight [N, K] -> [M, N] bf16 (float32 sums, one rounding).

    dot: True multiplies with VDPBF16PS (AVX512-BF16 only), False widens to float32 and sums in k
    order with FMA (bit-reproducible in torch); None takes VDPBF16PS where the CPU has it.
    """
    if dot is None:
        dot = bf16_dot_instruction()
    elif dot and not bf16_dot_instruction():
        raise ValueError("dot=True needs a CPU with AVX512-BF16 (avx512_bf16 in /proc/cpuinfo)")
    return _module().bf16_linear(x, panels, out_features, dot)


if __name__ == "__main__":  # scripts/setup.sh and the image: build before the first engine start
    # Never without AVX-512: loading the built module there could execute AVX-512 code and
    # crash; the engine then builds it on first use on an AVX-512 machine (the image has g++).
    if avx512():
        print("building the AVX-512 bf16 linear kernel (once, about a minute)...", flush=True)
        _module()
    reason = unavailable_reason()
    print("AVX-512 bf16 linear kernel: " + ("ready" if reason is None else f"not used here: {reason}"))
