"""Single-stream decode with and without specmesh's C++ CPU kernels, interleaved in one process.

    python benchmarks/cpu_kernels_decode.py                       # default model, bf16, 64 tokens x 3 rounds
    python benchmarks/cpu_kernels_decode.py --variants fp16 bf16-avx512 bf16-avx512/bfloat16 --rounds 5
    python benchmarks/cpu_kernels_decode.py --variants bf16-avx512/bfloat16 gguf/bfloat16  # the GGUF's own blocks

Loads one engine per variant, `WEIGHTS[/KV_DTYPE]` (KV_DTYPE `auto` unless named). On a CPU without
native bf16, `fp16` is the pure-torch path: fbgemm linears, torch's row ops and attention;
`bf16-avx512` is the C++ path: specmesh's linear kernel and C++ row ops, in whichever ISA build the
CPU takes (services/target/kernels/cpu_kernels.py). There the KV pool's `auto` dtype is float32,
so attention stays torch's; `bf16-avx512/bfloat16` adds the C++ decode attention (bf16 pool
only). Prefills the same --context-token prompt in each, then
runs --tokens one-token decode steps per engine per round, the engines taking turns, so both see
the same machine load. Prints each round's tok/s (tokens / summed step time of `ModelRunner.forward`,
no scheduler, sampler or gRPC) and the median over rounds, and the bytes of linear-layer weights
a decode token reads (every packed weight once; the embedding lookup's one row left out).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.engine_step import StepBench, corpus_ids
from services.common.env import read_settings
from services.common.models.loading import resolve_model_dir
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.kernels import cpu_kernels


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed linear weights (what one decode token streams), counted once each."""
    from services.target.model.gguf_weights import GGUFLinear
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, GGUFLinear) and id(module) not in seen:
            seen.add(id(module))
            total += module.packed.nbytes()
        elif hasattr(module, "panels") and id(module) not in seen:  # AVX512LinearBF16
            seen.add(id(module))
            total += module.panels.numel() * module.panels.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--variants", nargs="+", default=["fp16", "bf16-avx512", "bf16-avx512/bfloat16"],
                        help="WEIGHTS[/KV_DTYPE]: a --weights format (none, bf16, bf16-avx512, fp16, int8) "
                             "and a KV pool dtype (auto, bfloat16, float32)")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    engines = {}
    for v in args.variants:
        weights, _, kv = v.partition("/")
        engines[v] = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_blocks=256,
                                              weights=weights, kv_dtype=kv or "auto"))
    try:
        ids = corpus_ids(next(iter(engines.values())).tokenizer, args.context + args.tokens * (args.rounds + 1))
        benches = {w: StepBench(e, ids, 512) for w, e in engines.items()}
        for w, e in engines.items():  # warm-up: first-call setup is not a step
            e.run_on_engine_thread(lambda b=benches[w]: b.decode_steps([args.context], 3))
        rates: dict[str, list[float]] = {w: [] for w in engines}
        for r in range(args.rounds):
            for w, e in engines.items():
                times = e.run_on_engine_thread(lambda b=benches[w]: b.decode_steps([args.context], args.tokens))
                rates[w].append(len(times) / sum(times))
            print(f"round {r + 1}: " + "  ".join(f"{w} {rates[w][-1]:6.1f} tok/s" for w in engines), flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    print(f"\nmodel={args.model} bf16 threads={torch.get_num_threads()} context={args.context} "
          f"tokens={args.tokens} rounds={args.rounds} kernel ISA={cpu_kernels.isa()} "
          f"({cpu_kernels.unavailable_reason() or 'C++ kernels available'})")
    for w in engines:
        row_ops = engines[w].runner.lean_forward.row_ops if hasattr(engines[w].runner, "lean_forward") else "?"
        print(f"{w:>21}: median {statistics.median(rates[w]):6.1f} tok/s  (rounds: "
              f"{', '.join(f'{x:.1f}' for x in rates[w])}; C++ row ops: {row_ops}; "
              f"KV pool {engines[w].config.torch_kv_dtype}; linear weights read per token: "
              f"{linear_weight_bytes(engines[w].runner.model) / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
