"""How fast each `--weights` format multiplies the default model's matrix shapes on this CPU.

    python benchmarks/linear_formats.py              # 1 and 18 rows, torch's default threads
    python benchmarks/linear_formats.py --rows 1 4 18 64

For the 262k-row lm_head and the largest layer matrices of Gemma 3 270M (random weights of the
same shapes; the speed does not depend on the values) it prints the median milliseconds per
call of torch's bf16 `F.linear` (what Hugging Face runs), fbgemm fp16 packing (`fp16`),
oneDNN bf16 packing (`bf16`, where oneDNN runs bf16), specmesh's AVX-512 kernel
(`bf16-avx512`, where it builds), fbgemm int8 (`int8`) and the GGUF kernel (`gguf`, where the
CPU has AVX512-BF16 or AVX2: random blocks of the type the default model's file stores at that shape),
and the weight bytes streamed per second (for `gguf`, the bytes of its layout, not bf16's).
Small matrices stay in cache between calls, so their GB/s are cache rates; the lm_head's are
memory rates.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from services.target.kernels import cpu_gguf_linear, cpu_linear
from services.target.model.gguf_weights import GGUFLinear
from services.target.model.linear import (AVX512LinearBF16, Int8Linear, PackedLinearBF16, PackedLinearFP16,
                                    native_bf16_cpu)

SHAPES = {"lm_head": (262144, 640), "mlp.gate_up": (4096, 640), "mlp.down_proj": (640, 2048),
          "attn.qkv": (1536, 640), "attn.o_proj": (640, 1024)}  # (out_features, in_features), fused as served
# The block type the default model's Q4_K_M file stores at each shape (ffn_down is Q4_K in half
# the layers, attn_v Q8_0 in half: the slower of each here), and the range of its integers q.
GGUF_TYPES = {"lm_head": ("Q8_0", -127, 127), "mlp.gate_up": ("Q5_0", -16, 15), "mlp.down_proj": ("Q6_K", -32, 31),
              "attn.qkv": ("Q5_0", -16, 15), "attn.o_proj": ("Q4_K", 0, 15)}


class RandomGGUF:
    """Builds a GGUFLinear over random blocks of one shape's type (the speed does not depend on the values)."""

    def __init__(self, name: str):
        self.type_name, self.low, self.high = GGUF_TYPES[name]

    def __call__(self, layer: nn.Linear) -> GGUFLinear:
        n, k = layer.out_features, layer.in_features
        sub = cpu_gguf_linear.BLOCK_TYPES[self.type_name][2]
        rng = np.random.default_rng(0)
        scales = (rng.random((n, k // sub)) * 1e-2).astype(np.float32)
        offsets = scales * 8 if self.type_name == "Q4_K" else None
        parts = cpu_gguf_linear.Decoded(rng.integers(self.low, self.high + 1, size=(n, k), dtype=np.int8),
                                        scales, offsets, sub)
        return GGUFLinear(cpu_gguf_linear.pack(parts))


def median_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 18])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--formats", nargs="+", default=None,
                        help="any of: F.linear fp16 int8 bf16 bf16-avx512 gguf (default: all that run here)")
    args = parser.parse_args()
    formats = {"F.linear": None, "fp16": PackedLinearFP16, "int8": Int8Linear}
    if native_bf16_cpu():
        formats["bf16"] = PackedLinearBF16
    if cpu_linear.available():
        formats["bf16-avx512"] = AVX512LinearBF16
    if cpu_gguf_linear.available():
        formats["gguf"] = "gguf"
    if args.formats:
        formats = {f: cls for f, cls in formats.items() if f in args.formats}
    lines = []
    for name, (out_f, in_f) in tqdm(SHAPES.items(), desc="shapes"):
        layer = nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
        modules = {f: (layer if cls is None else RandomGGUF(name)(layer) if cls == "gguf" else cls(layer))
                   for f, cls in formats.items()}
        for rows in args.rows:
            x = torch.randn(rows, in_f).to(torch.bfloat16)  # [rows, in]
            cells = []
            for fmt, module in modules.items():
                with torch.inference_mode():
                    ms = median_ms(lambda: module(x), args.calls)
                nbytes = module.packed.nbytes() if fmt == "gguf" else out_f * in_f * 2
                gbs = nbytes / ms / 1e6  # bytes of the weight (bf16's, or the GGUF layout's) per second
                cells.append(f"{fmt} {ms:.3f} ms ({gbs:.0f} GB/s)")
            lines.append(f"{name:14} {out_f}x{in_f} rows={rows:<3} " + " | ".join(cells))
    print(f"threads={torch.get_num_threads()} oneDNN bf16={native_bf16_cpu()} "
          f"bf16 dot in hardware={cpu_linear.bf16_dot_instruction()}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
