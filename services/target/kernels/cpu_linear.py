"""The bf16 linear kernel (cpu_linear.cpp) of specmesh's CPU kernel module (AVX-512 or AVX2 build).

On a CPU with AVX512-BF16 the kernel multiplies with VDPBF16PS; on other AVX-512 CPUs and in the
AVX2 build it widens bf16 to float32 and uses FMA (`bf16_linear(dot=...)`; the default is what the CPU has). The
module is built and loaded by cpu_kernels.py; its availability checks are re-exported here.
"""

from __future__ import annotations

import torch

from .cpu_kernels import SOURCES as _SOURCES  # noqa: F401  (the module's sources, for packaging checks)
from .cpu_kernels import available, avx2, avx512, bf16_dot_instruction, cpu_flags, isa, unavailable_reason  # noqa: F401
from .cpu_kernels import module as _module


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
