"""How close single-stream decode comes to the machine's memory bandwidth (issue 27's roofline).

    python -m benchmarks.memory_roofline benchmarks/results/compare-*.json [--gb 2 --repeats 9]

Single-stream decode of a small model reads every weight once a token, so bytes per token x
tokens/s can reach at most the bandwidth a streaming read gets. This measures that read (a
float32 sum over a buffer of --gb GB with the two cores, several times: the bandwidth a shared
machine gives moves between runs, so min / median / max are printed) and, for each system in
the given compare.py results, its single-stream tok/s x its bytes per token as a share of the
median: specmesh's weight formats as specmesh counts them (services.target.model.linear), the
llama.cpp systems as their GGUF file's size (every tensor is read once a token; the tied
embedding is the output layer), vLLM as the model's bf16 weights. Measure the bandwidth in the
same session as the compare run: a later one may find the machine in another state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# Bytes a decode token reads (weights only; the KV cache of a short context is small beside them).
# specmesh's: the packed linear weights of the default model as benchmarks/cpu_kernels_decode.py's
# linear_weight_bytes counts them (it prints them per format; loading the model here for two numbers
# would cost more than the read it is compared with).
SPECMESH_BYTES = {"auto": 536e6, "bf16-avx512": 536e6, "bf16": 536e6, "gguf": 294e6, "gguf-bf16": 294e6}  # gguf: Q4_K as nibbles
# With the argmax screen (greedy rows, the default where the CPU has AVX512-VNNI), the output layer's
# 335 MB of bf16 (189 MB of GGUF Q8_0 blocks) are not read: its 175 MB int8 copy is, and a few rows.
SCREENED_BYTES = {"auto": 376e6, "bf16-avx512": 376e6, "gguf": 281e6, "gguf-bf16": 281e6}
VLLM_BYTES = 536e6  # the default model in bf16, its tied embedding read as the output layer
LLAMACPP_FILES = {"llama.cpp BF16": "gemma-3-270m-bf16.gguf", "llama.cpp Q4_K_M": "gemma-3-270m-q4_k_m.gguf"}


def stream_bandwidth(gb: float, repeats: int) -> list[float]:
    """Bytes/s of a float32 sum over a fresh `gb` GB buffer (first touched before timing), per repeat."""
    x = torch.ones(int(gb * 1e9) // 4, dtype=torch.float32)  # [n], pages touched here
    x.sum()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - start))
    return rates


def bytes_per_token(system: str, weights: str, llamacpp_dir: Path, screened: bool = False) -> float | None:
    if system == "specmesh":
        return (SCREENED_BYTES if screened and weights in SCREENED_BYTES else SPECMESH_BYTES).get(weights)
    if system == "vLLM":
        return VLLM_BYTES
    if system in LLAMACPP_FILES:
        path = llamacpp_dir / "models" / LLAMACPP_FILES[system]
        return path.stat().st_size if path.exists() else None
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("results", nargs="*", type=Path, help="compare.py's JSON results")
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--llamacpp-dir", type=Path, default=Path.home() / ".cache" / "specmesh" / "llamacpp")
    args = p.parse_args()
    rates = stream_bandwidth(args.gb, args.repeats)
    bw = statistics.median(rates)
    print(f"streaming read, {args.gb:g} GB, {torch.get_num_threads()} threads: median {bw / 1e9:.1f} GB/s "
          f"(min {min(rates) / 1e9:.1f}, max {max(rates) / 1e9:.1f}, {args.repeats} reads)")
    if not args.results:
        return
    print("\n| run | system | single-stream tok/s | MB a token | GB/s | share of the median read |")
    print("|---|---|---:|---:|---:|---:|")
    for path in args.results:
        data = json.loads(path.read_text())
        # the format the target served (compare.py records it); older runs only what was asked, and
        # their "auto" was bf16-avx512 (auto picks gguf-bf16 for the default model since 2026-12-07)
        weights = data["result"].get("_weights") or data["args"].get("specmesh_weights", "auto")
        for system, tok_s in data["result"]["single"].items():
            if system.startswith("_") or tok_s is None:
                continue
            # runs before the screen (2026-12-05 09:00) recorded no switches; it did not exist then
            screened = "switches" in data and data["switches"].get("SPECMESH_ARGMAX_SCREEN", "1") != "0"
            nbytes = bytes_per_token(system, weights, args.llamacpp_dir, screened)
            if nbytes is None:
                continue
            label = f"specmesh ({weights})" if system == "specmesh" else system
            print(f"| {path.stem} | {label} | {tok_s:.1f} | {nbytes / 1e6:.0f} | {tok_s * nbytes / 1e9:.1f} | "
                  f"{tok_s * nbytes / bw:.0%} |")


if __name__ == "__main__":
    main()
