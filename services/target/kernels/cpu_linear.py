"""The bf16 linear kernel (cpu_linear.cpp) of specmesh's CPU kernel module (AVX-512 or AVX2 build).

On a CPU with AVX512-BF16 the kernel multiplies with VDPBF16PS; on other AVX-512 CPUs and in the
AVX2 build it widens bf16 to float32 and uses FMA (`bf16_linear(dot=...)`; the default is what the CPU has). On a
CPU with AMX, calls of AMX_MIN_ROWS rows or more go to the AMX tile kernel (cpu_amx_linear.cpp) over the
same panels. The module is built and loaded by cpu_kernels.py; its availability checks are re-exported here.
"""

from __future__ import annotations

import functools

import torch

from .cpu_kernels import SOURCES as _SOURCES  # noqa: F401  (the module's sources, for packaging checks)
from .cpu_kernels import (amx_cpu, available, avx2, avx512, bf16_dot_instruction, cpu_flags, isa,  # noqa: F401
                          unavailable_reason)
from .cpu_kernels import module as _module


def amx_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """bf16_linear with AMX tiles whatever the rows (K a multiple of 32; the CPU must have AMX: `amx()`)."""
    if not amx():
        raise ValueError("amx_linear needs a CPU with AMX-BF16 whose OS grants the tile registers")
    return _module().bf16_linear_amx(x, panels, out_features)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> its panels [ceil(N / 32), ceil(K / 2), 64] bf16, the layout `bf16_linear` reads."""
    return _module().pack_bf16_weight(weight)


def panel_rows(panels: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows `ids` [C] of the weight `pack` laid out, as bf16 [C, in_features]: in a panel, k pair kk
    holds its 32 columns as two 16-column halves, a column's two k side by side."""
    col = ids % 32
    lanes = ((col // 16) * 32 + (col % 16) * 2)[:, None] + torch.arange(2)  # [C, 2]
    sel = panels.index_select(0, ids // 32)  # [C, K2, 64]
    pairs = sel.gather(2, lanes[:, None, :].expand(-1, sel.shape[1], -1))  # [C, K2, 2]
    return pairs.reshape(ids.shape[0], -1)[:, :in_features]


# From this many rows a call multiplies with AMX tiles where the CPU has them: at 1 row the VDPBF16PS
# loop streams the weights faster, at 2 they are even, from 3 the tiles win (docs/kernels.md).
AMX_MIN_ROWS = 3


@functools.cache
def amx() -> bool:
    """Whether calls of many rows multiply with AMX tiles here: the CPU has AMX-BF16, the OS granted
    the tile registers, and SPECMESH_AMX is not 0 (a switch to measure the VDPBF16PS loop alone)."""
    return amx_cpu() and bool(_module().amx_ready())


def takes_amx(rows: int, in_features: int) -> bool:
    """Whether a call of `rows` rows over `in_features` inputs multiplies with AMX tiles here."""
    return rows >= AMX_MIN_ROWS and in_features % 32 == 0 and amx()


def bf16_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, dot: bool | None = None) -> torch.Tensor:
    """x [M, K] bf16 times the packed weight [N, K] -> [M, N] bf16 (float32 sums, one rounding).

    dot: True multiplies with VDPBF16PS (AVX512-BF16 only), False widens to float32 and sums in k
    order with FMA (bit-reproducible in torch); None takes VDPBF16PS where the CPU has it, and AMX
    tiles for calls of AMX_MIN_ROWS rows or more where it has those (K a multiple of 32).
    """
    if dot is None:
        if takes_amx(x.shape[0], x.shape[1]):
            return _module().bf16_linear_amx(x, panels, out_features)
        dot = bf16_dot_instruction()
    elif dot and not bf16_dot_instruction():
        raise ValueError("dot=True needs a CPU with AVX512-BF16 (avx512_bf16 in /proc/cpuinfo)")
    return _module().bf16_linear(x, panels, out_features, dot)
