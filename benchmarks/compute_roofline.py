"""How close a cold prefill comes to the machine's bf16 arithmetic peak (issue 27's compute roofline).

    python -m benchmarks.compute_roofline [--tokens 2027 --repeats 5]

A long prefill of a small model is compute-bound: every prompt token goes through every layer
matrix (2 FLOPs a weight) and attends to the keys it sees. This measures:
  * the peak: VDPBF16PS (32 bf16 products, 64 FLOPs) in a loop of independent accumulators with
    no memory traffic, on one thread and on all of torch's threads (a tiny C++ probe built here);
  * the layer matrices of the model at the prefill's chunk size through specmesh's linear kernel
    (`bf16_linear`), as FLOP/s and a share of the peak;
  * a whole in-process prefill of --tokens tokens (as benchmarks/engine_step.py runs it), and the
    FLOPs it needs: the layer matrices, attention's two products over the keys each row sees
    (sliding windows counted as the model's config says), the last layer only for its keys and
    values and its last row, and the output layer of the last row.
A system's cold-prefill time in compare.py can then be read against the same FLOP count.
Needs AVX512-BF16.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

PROBE_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

__attribute__((target("avx512f,avx512bf16")))
static float spin(int64_t iterations) {
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(0.0f);
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x00010001);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);  // independent chains, in registers
  }
  __m512 s = acc[0];
  for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// FLOP/s of `iterations` x 24 VDPBF16PS on each of `threads` threads at once.
double peak_flops(int64_t iterations, int64_t threads) {
  std::vector<float> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) { for (int64_t t = b; t < e; ++t) sink[t] = spin(iterations); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sink[0];
  (void)keep;
  return iterations * 24.0 * 64.0 * threads / seconds;
}
"""


def probe_module():
    return load_inline("specmesh_compute_probe", PROBE_SOURCE, functions=["peak_flops"],
                       extra_cflags=["-O3", "-mavx512f"], verbose=False)


def peak(probe, threads: int, repeats: int) -> float:
    probe.peak_flops(2_000_000, threads)  # warm the clocks
    return max(probe.peak_flops(10_000_000, threads) for _ in range(repeats))


def layer_shapes(config) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decoder layer's matrices, q/k/v and gate/up as the runner fuses them."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", hidden // config.num_attention_heads)
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    return [("qkv", qkv, hidden), ("o", hidden, config.num_attention_heads * head_dim),
            ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def prefill_flops(config, tokens: int) -> dict[str, float]:
    """The FLOPs a prefill of `tokens` needs: every layer's matrices and attention for every row,
    but the last layer's only for its keys and values and for the last row (the only one read:
    services/target/model/output_rows.py), and the output layer for the last row."""
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    layer = sum(n * k for _, n, k in layer_shapes(config))
    kv = 2 * config.num_key_value_heads * head_dim * config.hidden_size
    layers = config.num_hidden_layers
    linear = 2.0 * tokens * layer * (layers - 1) + 2.0 * tokens * kv + 2.0 * (layer - kv)
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    window = getattr(config, "sliding_window", None) or tokens
    attention = 0.0
    for i, kind in enumerate(types):
        span = window if kind == "sliding_attention" else tokens
        seen = min(tokens, span) if i == layers - 1 else sum(min(j + 1, span) for j in range(tokens))
        attention += 2 * 2.0 * seen * head_dim * config.num_attention_heads  # q.k and p.v
    output = 2.0 * config.vocab_size * config.hidden_size  # the last row's logits
    return {"linear": linear, "attention": attention, "output": output}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=2027, help="prefill length (compare.py's cold prompt: ~2,027)")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from benchmarks.engine_step import StepBench, corpus_ids
    from services.common.models.loading import resolve_model_dir
    from services.settings import read_settings
    from services.target.config import EngineConfig
    from services.target.engine.engine import Engine
    from services.target.kernels import cpu_linear

    threads = torch.get_num_threads()
    probe = probe_module()
    one, every = peak(probe, 1, args.repeats), peak(probe, threads, args.repeats)
    print(f"VDPBF16PS peak: {one / 1e9:.0f} GFLOP/s on 1 thread, {every / 1e9:.0f} on {threads}")

    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_blocks=2048))
    config = engine.runner.model.config
    config = getattr(config, "text_config", config)
    total_linear = 0.0
    print(f"\nlinear kernel at {args.chunk} rows (median of {args.repeats}):")
    for name, n, k in layer_shapes(config):
        x = torch.randn(args.chunk, k).to(torch.bfloat16)
        w = (torch.randn(n, k) / k ** 0.5).to(torch.bfloat16)
        packed = cpu_linear.pack(w)
        cpu_linear.bf16_linear(x, packed, n)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            cpu_linear.bf16_linear(x, packed, n)
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        flops = 2.0 * args.chunk * n * k
        total_linear += t * (config.num_hidden_layers - 1) * args.tokens / args.chunk
        print(f"  {name:8s} [{args.chunk}, {k}] x [{n}, {k}]^T  {t * 1e3:6.2f} ms  {flops / t / 1e9:5.0f} GFLOP/s"
              f"  {flops / t / every:4.0%} of peak")

    bench = StepBench(engine, corpus_ids(engine.tokenizer, args.tokens), args.chunk)
    try:
        engine.run_on_engine_thread(lambda: bench.timed_prefills(args.tokens, 1))  # warm-up
        prefill = statistics.median(engine.run_on_engine_thread(lambda: bench.timed_prefills(args.tokens, args.repeats)))
    finally:
        engine.shutdown()
    counts = prefill_flops(config, args.tokens)
    total = sum(counts.values())
    print(f"\nprefill of {args.tokens} tokens in chunks of {args.chunk}: {prefill:.3f} s (median of {args.repeats})")
    print("  FLOPs: " + ", ".join(f"{k} {v / 1e9:.0f} G" for k, v in counts.items()) + f"; total {total / 1e9:.0f} G")
    print(f"  {total / prefill / 1e9:.0f} GFLOP/s = {total / prefill / every:.0%} of peak;"
          f" all but the last layer's matrices at the kernel's rate above: {total_linear:.3f} s")
    print(f"  at the peak the whole prefill would take {total / every:.3f} s")


if __name__ == "__main__":
    main()
