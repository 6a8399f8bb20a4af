"""Builds and loads specmesh's CPU kernel module, `specmesh_cpu_kernels`, on first use.

It holds the bf16 linear kernel (cpu_linear.cpp, and its AMX tile path cpu_amx_linear.cpp, wrapped
in cpu_linear.py), the linear kernel over GGUF block-quantized weights (cpu_gguf_linear.cpp, wrapped
in cpu_gguf_linear.py), Gemma 3's
per-row ops (cpu_rowops.cpp) and the paged bf16 attention of decode rows and prefill chunks
(cpu_decode_attention.cpp, cpu_chunk_attention.cpp), all wrapped in cpu_rowops.py, and a decoder
layer of decode rows made of them in one call (cpu_decode_layer.cpp, decode_layer.py); the
prototypes are in cpu_kernels.h, the Python bindings in cpu_kernels.cpp.

It is built for one instruction set, the best the CPU has (`isa()`): "avx512" (AVX-512
F/BW/DQ/VL, 16-lane loops; VDPBF16PS where the CPU also has AVX512-BF16) or "avx2" (AVX2 + FMA
+ F16C, 8-lane loops: AMD Zen 2/3, most consumer Intel). The C++ files keep each ISA's loops
apart behind a define (SPECMESH_ISA_AVX512 / SPECMESH_ISA_AVX2, cpu_simd.h); the prefill chunk
kernel is VDPBF16PS only, so the AVX2 build leaves prefill chunks to torch.

The module is compiled with torch's own extension builder (`torch.utils.cpp_extension.load`,
ninja and the system C++ compiler) into torch's extension cache, under a name that carries the
ISA (`specmesh_cpu_kernels_avx512`, `specmesh_cpu_kernels_avx2`: a cache shared by machines of
both kinds never hands one the other's build), so a machine compiles it once (~1 minute;
`scripts/setup.sh` does it ahead of time). Where it cannot be built or the CPU has neither
instruction set, `available()` says why and the engine keeps oneDNN.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

MODULE_NAME = "specmesh_cpu_kernels"
SOURCES = [str(Path(__file__).with_name(name)) for name in (
    "cpu_kernels.cpp", "cpu_linear.cpp", "cpu_amx_linear.cpp", "cpu_gguf_linear.cpp", "cpu_rowops.cpp",
    "cpu_decode_attention.cpp", "cpu_decode_layer.cpp", "cpu_chunk_attention.cpp", "cpu_argmax_screen.cpp",
    "cpu_argmax_rows.cpp")]
_FLAGS = ["-O3", "-fopenmp"]
# Per ISA: the compiler's target flags and the define that picks the C++ loops (cpu_simd.h).
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-DSPECMESH_ISA_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DSPECMESH_ISA_AVX2"],
}


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


@functools.cache
def amx_cpu() -> bool:
    """Whether the CPU has AMX-BF16 tiles and SPECMESH_AMX is not 0 (the switch that keeps specmesh's
    kernels and choices off them, to measure the other paths). Read once per process: attention asks
    on every layer of every step."""
    return os.environ.get("SPECMESH_AMX", "1") != "0" and avx512() and {"amx_bf16", "amx_tile"} <= cpu_flags()


def avx512() -> bool:
    flags = cpu_flags()
    return platform.machine() in ("x86_64", "AMD64") and {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags


def avx2() -> bool:
    """AVX2 with FMA and F16C (every x86 CPU since Haswell / Zen 1 that has AVX2 at all)."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= cpu_flags()


def isa() -> str | None:
    """The instruction set the module is built for here: "avx512", "avx2", or None (neither)."""
    return "avx512" if avx512() else "avx2" if avx2() else None


def extension_name(isa_name: str) -> str:
    """The module's name in torch's extension cache for one ISA (its build directory's name)."""
    return f"{MODULE_NAME}_{isa_name}"


def build(isa_name: str):
    """Builds (or loads from torch's cache) the module for `isa_name` and returns it. Compiling
    works on any x86 CPU; only calling into a build for an ISA the CPU lacks would crash."""
    from torch.utils.cpp_extension import load

    return load(name=extension_name(isa_name), sources=SOURCES, extra_cflags=_FLAGS + ISA_FLAGS[isa_name],
                extra_ldflags=["-fopenmp"], verbose=os.environ.get("SPECMESH_VERBOSE_BUILD") == "1")


@functools.cache
def module():
    """The loaded extension module for this CPU's ISA (built first if torch's cache has none)."""
    name = isa()
    if name is None:
        raise RuntimeError(f"specmesh's CPU kernels need AVX-512 or AVX2: {unavailable_reason()}")
    return build(name)


@functools.cache
def unavailable_reason() -> str | None:
    """None if the module runs here, else why not (what a user can do about it)."""
    if isa() is None:
        return "the CPU has neither AVX-512 (avx512f/bw/dq/vl) nor AVX2 with FMA and F16C"
    try:
        module()
    except Exception as exc:  # a missing compiler or ninja: report it, keep serving with oneDNN
        return f"the kernel did not build ({type(exc).__name__}: {exc}); install ninja and a C++ compiler"
    return None


def available() -> bool:
    return unavailable_reason() is None


if __name__ == "__main__":  # scripts/setup.sh and the image: build before the first engine start
    # Only this CPU's ISA: the engine builds the other's on first use on such a machine (the
    # image has g++), and the cache keeps the two apart (extension_name).
    if isa() is not None:
        print(f"building specmesh's {isa()} CPU kernels (once, about a minute)...", flush=True)
        try:
            module()
        except Exception:  # reported below, as the engine would
            pass
    reason = unavailable_reason()
    print(f"{isa() or 'SIMD'} CPU kernels: " + ("ready" if reason is None else f"not used here: {reason}"))
