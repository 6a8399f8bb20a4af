"""How fast each `--weights` format multiplies the default model's matrix shapes on this CPU.

    python benchmarks/linear_formats.py              # 1 and 18 rows, torch's default threads
    python benchmarks/linear_formats.py --rows 1 4 18 64

For the 262k-row lm_head and the largest layer matrices of Gemma 3 270M (random weights of the
same shapes; the speed does not depend on the values) it prints the median milliseconds per
call of torch's bf16 `F.linear` (what Hugging Face runs), fbgemm fp16 packing (`fp16`),
oneDNN bf16 packing (`bf16`, where oneDNN runs bf16), specmesh's AVX-512 kernel
(`bf16-avx512`, where it builds) and fbgemm int8 (`int8`),
and the weight bytes streamed per second. Small matrices stay in cache between calls, so
their GB/s are cache rates; the lm_head's are memory rates.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from tqdm import tqdm

from services.target.kernels import cpu_linear
from services.target.model.linear import (AVX512LinearBF16, Int8Linear, PackedLinearBF16, PackedLinearFP16,
                                    native_bf16_cpu)

SHAPES = {"lm_head": (262144, 640), "mlp.gate_up": (4096, 640), "mlp.down_proj": (640, 2048),
          "attn.qkv": (1536, 640), "attn.o_proj": (640, 1024)}  # (out_features, in_features), fused as served


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
                        help="any of: F.linear fp16 int8 bf16 bf16-avx512 (default: all that run here)")
    args = parser.parse_args()
    formats = {"F.linear": None, "fp16": PackedLinearFP16, "int8": Int8Linear}
    if native_bf16_cpu():
        formats["bf16"] = PackedLinearBF16
    if cpu_linear.available():
        formats["bf16-avx512"] = AVX512LinearBF16
    if args.formats:
        formats = {f: cls for f, cls in formats.items() if f in args.formats}
    lines = []
    for name, (out_f, in_f) in tqdm(SHAPES.items(), desc="shapes"):
        layer = nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
        modules = {f: (layer if cls is None else cls(layer)) for f, cls in formats.items()}
        for rows in args.rows:
            x = torch.randn(rows, in_f).to(torch.bfloat16)  # [rows, in]
            cells = []
            for fmt, module in modules.items():
                with torch.inference_mode():
                    ms = median_ms(lambda: module(x), args.calls)
                gbs = out_f * in_f * 2 / ms / 1e6  # bf16 bytes of the weight per second
                cells.append(f"{fmt} {ms:.3f} ms ({gbs:.0f} GB/s)")
            lines.append(f"{name:14} {out_f}x{in_f} rows={rows:<3} " + " | ".join(cells))
    print(f"threads={torch.get_num_threads()} oneDNN bf16={native_bf16_cpu()} "
          f"bf16 dot in hardware={cpu_linear.bf16_dot_instruction()}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
