"""Linear layers over GGUF block-quantized weights (cpu_gguf_linear.cpp): Q8_0, Q5_0, Q4_K, Q6_K.

Each of these block types dequantizes to w = S * q - D in float32, with q a small integer and S,
D per sub-block of 16 or 32 k (D = 0 for the symmetric Q8_0, Q5_0, Q6_K). `decode_blocks` reads a
tensor's raw blocks (the bytes of the file, as `gguf.GGUFReader` maps them) into those three parts
(the layouts of llama.cpp's ggml-common.h block_q8_0 / block_q5_0 / block_q4_K / block_q6_K, as
`gguf.quants` dequantizes them), `pack` lays them out for the kernel, and `gguf_linear` multiplies
with VDPBF16PS (FMA on AVX2), expanding each weight to round_bf16(S * q - D) in registers, the bf16
value today's conversion to bf16 produces (services/common/models/prepare.py): so the outputs equal
`cpu_linear.bf16_linear(x, pack(dequantized bf16 weight), N)` bit for bit (dot=True where the CPU
has it).

The kernel needs AVX512-BF16 on an AVX-512 CPU, or AVX2 with FMA, where it widens each weight and
sums with FMA as that build's bf16_linear does (`available()`); the layout stores q as one int8 per
weight, so a tensor takes ~1.1 bytes a weight (Q8_0's own size; Q5_0 and Q6_K pack tighter in the file), except
where every q is in [0, 15] (Q4_K): two a byte, ~0.75 bytes a weight with the float32 scales and offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import cpu_linear, huge_pages
from .cpu_kernels import available as _module_available
from .cpu_kernels import bf16_dot_instruction, isa, module, unavailable_reason as _module_unavailable_reason

GROUP = 16  # output columns per kernel group
# Block types the kernel serves: name -> (weights per block, bytes per block, k per sub-block)
BLOCK_TYPES = {"Q8_0": (32, 34, 32), "Q5_0": (32, 22, 32), "Q4_K": (256, 144, 32), "Q6_K": (256, 210, 16)}


def unavailable_reason() -> str | None:
    """None if gguf_linear runs here, else why not: the AVX-512 build multiplies with VDPBF16PS, the
    AVX2 build with FMA (cpu_gguf_linear_avx2.h); an AVX-512 CPU without AVX512-BF16 has neither."""
    if isa() == "avx512" and not bf16_dot_instruction():
        return "the CPU lacks AVX512-BF16 (avx512_bf16 in /proc/cpuinfo), which the GGUF kernel multiplies with"
    return _module_unavailable_reason()


def available() -> bool:
    return unavailable_reason() is None and _module_available()


def auto_takes_blocks() -> bool:
    """Whether `--weights auto` serves a GGUF's blocks here: where the kernel multiplies with
    VDPBF16PS. AVX2 has no instruction that rounds to bf16, so the exact expansion costs ~10 vector operations
    per 8 weights there and a one-row call is compute-bound: on a 2-core Zen 3 (`python
    benchmarks/linear_formats.py --formats bf16-avx512 gguf --rows 1 2 18`) the lm_head from memory
    took 15.1 ms against bf16_linear's 11.7, the layers 1.6-2.4x bf16's time. There `--weights gguf`
    serves the blocks for their memory (about half the bf16 weights' bytes), and `auto` keeps bf16-avx512."""
    return available() and bf16_dot_instruction()


@dataclass
class Decoded:
    """A tensor's weights as w = S * q - D: q [N, K] int8, scales/offsets [N, K / sub_block] f32
    (offsets None: all zero)."""
    q: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    sub_block: int


def decode_blocks(raw: np.ndarray, type_name: str) -> Decoded:
    """raw: [N, blocks per row * block bytes] uint8, one row per output feature -> its Decoded parts."""
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"GGUF block type {type_name} is not served natively; served: {', '.join(BLOCK_TYPES)}")
    per_block, block_bytes, sub = BLOCK_TYPES[type_name]
    rows = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"{type_name} rows must be whole {block_bytes}-byte blocks, got {raw.shape}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)  # [N * nb, bytes]
    n = blocks.shape[0]
    offsets = None
    if type_name == "Q8_0":
        scales = _f16(blocks[:, 0:2])[:, None]  # [n, 1]
        q = blocks[:, 2:].view(np.int8)  # [n, 32]
    elif type_name == "Q5_0":
        scales = _f16(blocks[:, 0:2])[:, None]
        high = blocks[:, 2:6].copy().view(np.uint32)[:, 0:1] >> np.arange(32, dtype=np.uint32)  # bit j: weight j's 5th bit
        nibbles = blocks[:, 6:22]  # byte j: weight j (low), weight j + 16 (high)
        low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # [n, 32]
        q = ((low | ((high & 1).astype(np.uint8) << 4)).astype(np.int16) - 16).astype(np.int8)
    elif type_name == "Q4_K":
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, m = _k_scale_min(blocks[:, 4:16])  # [n, 8] each, 6-bit
        scales = d * sc.astype(np.float32)  # exact in float32 (11 x 6 bits)
        offsets = dmin * m.astype(np.float32)
        chunks = blocks[:, 16:144].reshape(n, 4, 1, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c+1 (high)
        q = np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 256).astype(np.int8)
    else:  # Q6_K: ql [128], qh [64], scales int8 [16], d fp16
        ql = blocks[:, 0:128].reshape(n, 2, 1, 64)  # two halves of 128 weights
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # half, quarter, 32
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ((low | ((qh & 3) << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, 256)
        scales = _f16(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    per_row = raw.shape[1] // block_bytes * per_block
    subs = per_row // sub
    return Decoded(q.reshape(rows, per_row), np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, subs),
                   None if offsets is None else np.ascontiguousarray(offsets, dtype=np.float32).reshape(rows, subs),
                   sub)


def _f16(two_bytes: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> [n] f32 (exact)
    return np.ascontiguousarray(two_bytes).view(np.float16)[:, 0].astype(np.float32)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def dequantize_bf16(parts: Decoded) -> torch.Tensor:
    """The weights [N, K] as bf16: round_bf16(S * q - D), two float32 operations as gguf.quants does them."""
    q = torch.from_numpy(parts.q).float()
    w = q * torch.from_numpy(parts.scales).repeat_interleave(parts.sub_block, dim=1)
    if parts.offsets is not None:
        w = w - torch.from_numpy(parts.offsets).repeat_interleave(parts.sub_block, dim=1)
    return w.to(torch.bfloat16)


def concat(parts: list[Decoded]) -> Decoded:
    """Tensors stacked along N (a fused projection) in one form: the finest sub-block of any (a scale
    repeated over a finer sub-block is the same S), offsets where any has them (zeros elsewhere: x - 0 = x)."""
    sub = min(p.sub_block for p in parts)
    with_offsets = any(p.offsets is not None for p in parts)

    def per_sub(a: np.ndarray, p: Decoded) -> np.ndarray:
        return np.repeat(a, p.sub_block // sub, axis=1)

    return Decoded(np.concatenate([p.q for p in parts]),
                   np.concatenate([per_sub(p.scales, p) for p in parts]),
                   np.concatenate([per_sub(p.offsets if p.offsets is not None else np.zeros_like(p.scales), p)
                                   for p in parts]) if with_offsets else None, sub)


@dataclass
class Packed:
    """The kernel's layout of one weight [N, K] (cpu_gguf_linear.cpp)."""
    quants: torch.Tensor  # [ceil(N / 16), K / 2, 32] int8, or [.., 16] uint8 nibbles (`nibbles`)
    scales: torch.Tensor  # [ceil(N / 16), K / sub_block, 16] f32
    offsets: torch.Tensor  # same, or empty: none
    out_features: int
    in_features: int
    sub_block: int

    @property
    def nibbles(self) -> bool:
        """Two q a byte: byte i of a [g, kk] row holds the int8 layout's bytes i (low) and 16 + i (high)."""
        return self.quants.dtype == torch.uint8

    def int8_quants(self) -> torch.Tensor:
        """The quants in the int8 layout [ceil(N / 16), K / 2, 32], whichever layout is stored."""
        return _int8_layout(self.quants)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.offsets))


def pack(parts: Decoded) -> Packed:
    n, k = parts.q.shape
    if k % parts.sub_block or parts.sub_block % 2:
        raise ValueError(f"K={k} must be a multiple of the sub-block {parts.sub_block}")
    groups = (n + GROUP - 1) // GROUP
    pad = groups * GROUP - n

    def grouped(a: np.ndarray) -> torch.Tensor:  # [N, C] -> [G, 16, C], zero rows past N
        t = torch.from_numpy(np.ascontiguousarray(a))
        return torch.nn.functional.pad(t, (0, 0, 0, pad)).view(groups, GROUP, -1)

    quants = grouped(parts.q).view(groups, GROUP, k // 2, 2).permute(0, 2, 1, 3).reshape(groups, k // 2, 2 * GROUP)
    if parts.q.size and int(parts.q.min()) >= 0 and int(parts.q.max()) <= 15:  # Q4_K: nibbles, half the bytes
        q = quants.to(torch.uint8)
        quants = q[:, :, :GROUP] | (q[:, :, GROUP:] << 4)  # [G, K / 2, 16]
    scales = grouped(parts.scales).permute(0, 2, 1).contiguous()
    offsets = (grouped(parts.offsets).permute(0, 2, 1).contiguous() if parts.offsets is not None
               else torch.empty(0, dtype=torch.float32))
    return Packed(huge_pages.place(quants.contiguous()), huge_pages.place(scales), huge_pages.place(offsets), n, k,
                  parts.sub_block)


def gguf_linear(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x [M, K] bf16 times the weight [N, K] -> [M, N] bf16 (float32 sums over k pairs in order, one rounding).

    Rows that `cpu_linear.bf16_linear` would multiply with AMX tiles go through the same tiles (over each
    panel expanded to bf16), so the outputs stay equal to bf16_linear's over the dequantized weight."""
    amx = cpu_linear.takes_amx(x.shape[0], w.in_features)
    return module().gguf_linear(x, w.quants, w.scales, w.offsets, w.out_features, amx)


def _int8_layout(quants: torch.Tensor) -> torch.Tensor:
    """[..., 32] int8 quants as stored, or [..., 16] uint8 nibbles unpacked to them."""
    if quants.dtype != torch.uint8:
        return quants
    q = quants.to(torch.int16)
    return torch.cat([q & 0x0F, q >> 4], dim=-1).to(torch.int8)


def rows(w: Packed, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of the weight [N, K] as bf16 [T, K]: an embedding lookup in the tied table, and
    the argmax screen's exact tokens (one C++ call: in torch ops the screen's rows took ~7% of a decode step)."""
    return module().gguf_rows(w.quants, w.scales, w.offsets, ids, w.out_features)
