"""The output layer for rows that only need their argmax (plain greedy rows), exact and cheaper.

A greedy row reads one number from its logits: the index of the largest. On the default model
the output layer is 262,144 x 640 bf16 weights (335 MB), read once a decode step, about 40% of
what a step reads. The screen keeps a second copy of it in int8 (one fp16 scale per column and
block of 64 k, 32 where the hidden size is no multiple of 64: 175 MB) and runs, for the greedy rows
of a step:

1. an int8 pass over the whole vocabulary (cpu_argmax_screen.cpp, VPDPBUSD: 64 products an
   instruction against VDPBF16PS's 32, half the bytes; on AVX2 CPUs VPMADDUBSW + VPMADDWD, the same
   exact integer sums, half the bytes of the bf16 layer the widen + FMA loop streams) that gives
   every logit an approximate value a and a proven bound E with |exact - a| <= E;
2. the tokens whose upper bound a + E reaches the best lower bound of the row (less a margin of
   2^-6 of its size: two logits that far apart never round to the same bf16 value, so a token
   outside cannot tie the argmax either): on the default model a median of 25 of 262,144, a few
   thousand at worst (`python -m benchmarks.argmax_screen`);
3. those tokens' logits through the layer's own kernel (`cpu_linear.bf16_linear` over their
   gathered rows: the same VDPBF16PS sums in the same order as the whole layer's, so the same
   bits), and -inf for every other token.

So the argmax, ties included (the first index wins, as in the whole row), is the one the whole
layer gives, on any input: the bound is a worst case (Cauchy-Schwarz over the quantization errors
of w and x, plus the float32 roundings of both paths), not an estimate. The returned row is not
the whole row's softmax: only rows whose reader is the argmax alone may take it (the engine picks
them: services/target/engine/argmax_rows.py).

The bound, for a column w (bf16 values) and a row x (bf16 values) with w_hat = s q and x_hat = t p:
  x.w - x_hat.w_hat = x.(w - w_hat) + (x - x_hat).w_hat, so |.| <= |x| |w - w_hat| + |x - x_hat| |w_hat|;
  the kernel's float32 sum of x.w is within (K + 2) u |x| |w| of it (u = 2^-24; |w| <= |w - w_hat| + |w_hat|),
  and the screen's float32 sum of its blocks of B k within (K / B + 3) u |x_hat| |w_hat|.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import cpu_kernels, cpu_linear, huge_pages
from .cpu_kernels import cpu_flags, module

BLOCK = 32  # k per scale block (of the weights and of the rows) where the hidden size is not a
WIDE_BLOCK = 64  # multiple of WIDE_BLOCK; half the blocks: half the epilogue work and the scale bytes
# Rows from which the int8 pass runs on AMX-INT8 tiles where the CPU has them (the same results). On
# a 2-core Xeon, the default model, blocks of 64 (`python -m benchmarks.argmax_screen`, two runs):
# about even up to 4 rows (4 rows: 8.3 / 8.0 ms on tiles, 8.0 / 8.0 on the loop), tiles ahead from
# ~8 (12 rows: 11.9 / 11.5 against 12.2 / 12.3; 18 rows: 14.7 / 13.9 against 22.3 / 15.7).
AMX_MIN_ROWS = 8
GROUP = 16  # columns per kernel group
_U = 2.0 ** -24 * 1.01  # float32's unit roundoff, with room
_INFLATE = 1 + 2.0 ** -12  # the float32 ops that form a + E themselves round
_TIE_MARGIN = 2.0 ** -6  # two values this far apart (relative) round to different bf16 values


def unavailable_reason(in_features: int) -> str | None:
    """None if the screen runs for an output layer of `in_features` here, else why not."""
    if os.environ.get("SPECMESH_ARGMAX_SCREEN", "1") == "0":
        return "SPECMESH_ARGMAX_SCREEN=0"
    if not cpu_linear.available():
        return f"specmesh's kernels do not run here ({cpu_linear.unavailable_reason()})"
    if cpu_kernels.isa() == "avx512":  # the AVX2 build multiplies with VPMADDUBSW (cpu_argmax_screen_avx2.h)
        if not cpu_linear.bf16_dot_instruction():
            return "the CPU lacks AVX512-BF16 (the layer's own kernel the screen's exact tokens go through)"
        if "avx512_vnni" not in cpu_flags():
            return "the CPU lacks AVX512-VNNI (avx512_vnni in /proc/cpuinfo), which the int8 pass multiplies with"
    if in_features % BLOCK:
        return f"the hidden size {in_features} is not a multiple of {BLOCK}"
    return None


@dataclass
class ScreenWeights:
    """The int8 copy of an output layer [N, K] and its per-column error norms."""
    quants: torch.Tensor  # [ceil(N / 16), K / 4, 16, 4] uint8: q + 128
    scales: torch.Tensor  # [ceil(N / 16), K / block, 16] float16
    weight_err: torch.Tensor  # [N] float32: |w - s q|, rounded up
    weight_norm: torch.Tensor  # [N] float32: |s q|, rounded up
    out_features: int
    in_features: int
    block: int = BLOCK  # k per scale block

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.weight_err, self.weight_norm))


@torch.no_grad()  # weight_rows may read parameters that require grad: keep no graph per chunk
def quantize_weights(weight_rows: Callable[[torch.Tensor], torch.Tensor], out_features: int, in_features: int,
                     chunk: int = 16384, block: int = BLOCK) -> ScreenWeights:
    """The screen's copy of a layer whose rows `weight_rows(ids)` gives as bf16 [len(ids), K], one
    scale per column and `block` k."""
    n, k = out_features, in_features
    groups, blocks = (n + GROUP - 1) // GROUP, k // block
    quants = torch.full((groups * GROUP, k), 128, dtype=torch.uint8)
    scales = torch.zeros(groups * GROUP, blocks, dtype=torch.float16)
    err, norm = torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)
    for start in range(0, n, chunk):
        ids = torch.arange(start, min(n, start + chunk))
        w = weight_rows(ids).float().view(len(ids), blocks, block)  # [c, blocks, block], the bf16 values
        s = (w.abs().amax(-1) / 127).clamp(max=60000.0).to(torch.float16)  # [c, blocks]
        sf = s.float()[..., None]
        q = torch.where(sf > 0, torch.round(w / torch.where(sf > 0, sf, 1.0)), 0.0).clamp(-127, 127)
        w_hat = q.double() * sf.double()  # exact: 11 x 8 bits
        err[ids] = _up((w.double() - w_hat).flatten(1).norm(dim=1))
        norm[ids] = _up(w_hat.flatten(1).norm(dim=1))
        quants[ids] = (q.flatten(1) + 128).to(torch.uint8)
        scales[ids] = s
    quants = quants.view(groups, GROUP, k // 4, 4).permute(0, 2, 1, 3).contiguous()  # [G, K/4, 16, 4]
    scales = scales.view(groups, GROUP, blocks).permute(0, 2, 1).contiguous()  # [G, K/block, 16]
    return ScreenWeights(huge_pages.place(quants), huge_pages.place(scales), err, norm, n, k, block)


def _up(v: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 no smaller than v."""
    return (v * (1 + 1e-6)).float()


@functools.cache
def amx_int8() -> bool:
    """Whether the int8 pass runs on AMX-INT8 tiles here (a CPU with them, SPECMESH_AMX not 0, the OS
    grants the tile registers)."""
    return cpu_kernels.amx_cpu() and "amx_int8" in cpu_flags() and module().amx_ready()


def takes_amx(rows: int) -> bool:
    return rows >= AMX_MIN_ROWS and amx_int8()


def bounds(x: torch.Tensor, w: ScreenWeights, amx: bool | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 -> (upper bound of every logit [M, N] float32, best lower bound per row [M],
    the tokens [C] ascending whose upper bound reaches some row's best lower bound less the tie margin).
    amx: the int8 pass on AMX-INT8 tiles (None: from AMX_MIN_ROWS rows where `amx_int8`); the same
    results either way."""
    m, k = x.shape
    xf = x.float().view(m, k // w.block, w.block)  # [M, blocks, block]
    t = xf.abs().amax(-1) / 127  # [M, blocks]
    t = torch.where(t > 0, t, torch.ones_like(t))
    p = torch.round(xf / t[..., None]).clamp(-127, 127)  # [M, blocks, block]
    corr = (p.sum(-1) * 128).to(torch.int32)  # [M, blocks]
    x_norm = xf.double().flatten(1).norm(dim=1) * (1 + 1e-6)  # [M]
    dx_norm = (xf.double() - p.double() * t.double()[..., None]).flatten(1).norm(dim=1) * (1 + 1e-6)
    exact_err = (k + 2) * _U * x_norm  # the layer's own float32 sum, times |w| <= err + norm
    screen_err = (k // w.block + 3) * _U * (x_norm + dx_norm)  # the screen's float32 sum, times |w_hat|
    alpha = ((x_norm + exact_err) * _INFLATE).float()
    beta = ((dx_norm + exact_err + screen_err) * _INFLATE).float()
    return module().argmax_screen(p.to(torch.int8).view(m, k), t.contiguous(), corr, alpha, beta, w.quants,
                                  w.scales, w.weight_err, w.weight_norm, w.out_features, _TIE_MARGIN,
                                  takes_amx(m) if amx is None else amx)


class ArgmaxScreen:
    """Greedy rows' logits through the screen: exact where a token can be the argmax, -inf elsewhere.

    `weight_rows(ids)`: the layer's rows as the bf16 values its kernel multiplies (a tied table,
    or the GGUF blocks expanded as the GGUF kernel expands them)."""

    def __init__(self, weight_rows: Callable[[torch.Tensor], torch.Tensor], out_features: int, in_features: int):
        self.weight_rows = weight_rows
        block = WIDE_BLOCK if in_features % WIDE_BLOCK == 0 else BLOCK
        self.weights = quantize_weights(weight_rows, out_features, in_features, block=block)
        self.rows = 0  # rows screened since load, and the exact tokens they took (tests, benchmarks)
        self.exact_tokens = 0

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        """h [M, K] (the layer's input rows) -> logits [M, N] float32: exact at every token that can be
        its row's argmax, -inf elsewhere; None where more than an eighth of the vocabulary could be
        (a row of near-equal logits, e.g. an all-zero row): the whole layer is then cheaper."""
        x = h.to(torch.bfloat16).contiguous()  # what the layer multiplies
        upper, _, union = bounds(x, self.weights)  # union [C]: any row's possible argmax
        if union.numel() > self.weights.out_features // 8:
            return None
        self.rows += x.shape[0]
        self.exact_tokens += union.numel()
        # The same kernel call as the whole layer's, over C columns: the same M rows, so the same
        # dispatch (cpu_linear.bf16_linear) and the same float32 sums per column.
        exact = cpu_linear.bf16_linear(x, cpu_linear.pack(self.weight_rows(union)), union.numel())  # [M, C] bf16
        out = torch.full(upper.shape, float("-inf"), dtype=torch.float32)
        out[:, union] = exact.float()
        return out
