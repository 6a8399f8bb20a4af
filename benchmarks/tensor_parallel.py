"""Tensor parallel N against one rank on the same model, with the same total threads, in one run.

    python benchmarks/tensor_parallel.py                          # default model, TP 2 vs 1, 2 threads in all
    python benchmarks/tensor_parallel.py --model /path/to/hf-dir --dtype float32 --streams 1 8 --tokens 32

For each concurrency it reports aggregate greedy tokens/s of one rank with T threads and of N
ranks with T / N threads each (one process per rank over gloo on this machine), their ratio, and
the time per all-reduce on rank 0 (two per layer per step: after o_proj and after down_proj),
with the share of the TP run's step time spent in them. On a CPU the gain of tensor parallelism
is memory (each rank holds 1/N of the weights and KV heads), not speed: the ranks share the same
memory bandwidth, and every all-reduce is a synchronisation. Compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch

from services.bench.foreign_cpu import ForeignCpu
from services.common.models.loading import resolve_model_dir
from services.common.sampling_params import SamplingConfig
from services.settings import read_settings
from services.target.config import EngineConfig
from services.target.engine.engine import Engine

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash table works.",
           "List ten facts about the planet Mars.", "Give me a recipe for pancakes."]


def run(engine: Engine, streams: int, tokens: int) -> tuple[int, float]:
    """Greedy generation of `streams` concurrent requests; (tokens generated, seconds)."""
    done = threading.Semaphore(0)
    counts = [0] * streams

    def emitter(i):
        def emit(out):
            counts[i] += len(out.token_ids)
            if out.finish_reason is not None or out.error is not None:
                done.release()
        return emit
    start = time.perf_counter()
    for i in range(streams):
        ids = engine.tokenize(PROMPTS[i % len(PROMPTS)])
        engine.submit(f"bench-{time.monotonic_ns()}-{i}", ids, SamplingConfig(max_tokens=tokens, min_tokens=tokens),
                      emitter(i))
    for _ in range(streams):
        done.acquire()
    return sum(counts), time.perf_counter() - start


def measure(model_dir: Path, dtype: str, tensor_parallel: int, threads: int, streams: list[int],
            tokens: int) -> dict:
    torch.set_num_threads(threads)  # rank 0's; the other ranks take the same count
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype=dtype, tensor_parallel=tensor_parallel,
                                      kv_host_bytes=0, num_blocks=512))
    engine.start()
    try:
        run(engine, 1, 4)  # warm-up
        tp = engine.ranks.tp if engine.ranks else None
        results = {}
        for n in streams:
            before = (tp.all_reduces, tp.all_reduce_seconds) if tp else (0, 0.0)
            count, seconds = run(engine, n, tokens)
            reduces = (tp.all_reduces - before[0], tp.all_reduce_seconds - before[1]) if tp else (0, 0.0)
            results[n] = dict(tok_s=count / seconds, seconds=seconds, all_reduces=reduces[0],
                              all_reduce_s=reduces[1])
        return results
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="model directory or name (default: the settings' model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="total threads: one rank gets all, N ranks T / N each")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    settings = read_settings()
    model_dir = resolve_model_dir(args.model or settings.model, Path(settings.model_cache).expanduser())
    n = args.tensor_parallel
    if args.threads % n:
        parser.error(f"--threads {args.threads} must be a multiple of --tensor-parallel {n}")
    with ForeignCpu() as cpu:  # the ranks are this process's children: theirs is ours
        one = measure(model_dir, args.dtype, 1, args.threads, args.streams, args.tokens)
        many = measure(model_dir, args.dtype, n, args.threads // n, args.streams, args.tokens)
    foreign = cpu.share()
    print(f"foreign CPU while measuring: median {100 * (foreign['median'] or 0):.1f}%, "
          f"max {100 * (foreign['max'] or 0):.1f}%" + ("  VOID: another process used the machine" if foreign["void"] else ""))
    print(f"model {model_dir.name}, {args.dtype}, {args.tokens} tokens per stream, {args.threads} threads in all")
    print(f"{'streams':>7} {'TP1 tok/s':>10} {f'TP{n} tok/s':>10} {'ratio':>6} {'us/all-reduce':>14} {'AR share':>8}")
    for streams in args.streams:
        a, b = one[streams], many[streams]
        per = b["all_reduce_s"] / b["all_reduces"] * 1e6 if b["all_reduces"] else 0.0
        print(f"{streams:>7} {a['tok_s']:>10.1f} {b['tok_s']:>10.1f} {b['tok_s'] / a['tok_s']:>6.2f} "
              f"{per:>14.1f} {b['all_reduce_s'] / b['seconds']:>8.1%}")


if __name__ == "__main__":
    main()
