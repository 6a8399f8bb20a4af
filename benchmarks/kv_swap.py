"""Swap on preemption (--preemption-mode), one run per mode, side by side: the same requests on a
KV pool too small for their decode growth, so running sequences are preempted. Reports per mode
the wall time, preemptions swapped and recomputed, the measured cost per block of a swap (copy
out + copy in) and of a recompute (prefill-sized forwards), and whether the outputs are the same.

    python -m benchmarks.kv_swap [--model default --requests 6 --prompt-tokens 64 --max-tokens 96]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from services.bench.foreign_cpu import ForeignCpu
from services.common.env import read_settings
from services.common.models.loading import resolve_model_dir
from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine


def run_all(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Submits every prompt at once (greedy) and waits for all; their output tokens."""
    outputs, done, errors = [[] for _ in prompts], [threading.Event() for _ in prompts], []

    def emitter(i: int):
        def emit(out):  # on the engine thread
            outputs[i].extend(out.token_ids)
            if out.error is not None:
                errors.append(out.error)
            if out.finish_reason is not None or out.error is not None:
                done[i].set()
        return emit
    for i, prompt in enumerate(prompts):
        engine.submit(f"swap-bench-{time.monotonic_ns()}-{i}", prompt,
                      SamplingConfig(max_tokens=max_tokens, temperature=0.0, min_tokens=max_tokens), emitter(i))
    for event in done:
        event.wait()
    if errors:
        raise errors[0]
    return outputs


def measure(args, model_dir: Path) -> None:
    blocks_each = -(-args.prompt_tokens // args.block_size) + 1  # what admission needs per request
    num_blocks = args.requests * blocks_each  # all admitted at once; their decode growth does not fit
    print(f"model {model_dir.name}, {args.requests} requests of {args.prompt_tokens} prompt + {args.max_tokens} "
          f"output tokens, pool {num_blocks} blocks of {args.block_size} "
          f"(working set {args.requests * -(-(args.prompt_tokens + args.max_tokens) // args.block_size)})")
    results = {}
    for mode in args.modes.split(","):
        engine = Engine.load(EngineConfig(model_dir=model_dir, dtype=args.dtype, block_size=args.block_size,
                                          num_blocks=num_blocks, max_batched_tokens=512, max_num_seqs=args.requests,
                                          preemption_mode=mode, enable_prefix_caching=not args.no_prefix_caching))
        engine.start()
        try:
            tok = engine.tokenizer
            prompts = [tok(" ".join(f"request {i} line {j}: the quick brown fox." for j in range(args.prompt_tokens))
                           ).input_ids[:args.prompt_tokens] for i in range(args.requests)]
            run_all(engine, prompts[:1], 4)  # warm-up: the first forwards measure recompute
            start = time.perf_counter()
            outputs = run_all(engine, prompts, args.max_tokens)
            wall = time.perf_counter() - start
            s = engine.stats()
        finally:
            engine.shutdown()
        results[mode] = outputs
        swap_out = s.host_tier_swap_out_seconds / max(s.host_tier_swapped_out_blocks, 1)
        swap_in = s.host_tier_swap_in_seconds / max(s.host_tier_swapped_in_blocks, 1)
        print(f"  {mode:9s} wall {wall:7.2f} s  preemptions {s.num_preemptions} (swapped {s.swap_preemptions}, "
              f"recomputed {s.recompute_preemptions})  blocks swapped {s.host_tier_swapped_out_blocks}  "
              f"per block: swap out {swap_out * 1e3:.3f} ms + in {swap_in * 1e3:.3f} ms, "
              f"recompute {s.recompute_seconds_per_block * 1e3:.3f} ms  ({engine.runner.kv_block_bytes} bytes a block)")
    first = next(iter(results.values()))
    print(f"  same outputs in every mode: {all(out == first for out in results.values())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--modes", default="swap,recompute,auto")
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    with ForeignCpu() as cpu:  # CPU used by anything outside this process meanwhile
        measure(args, model_dir)
    foreign = cpu.share()
    print(f"foreign CPU while measuring: median {100 * (foreign['median'] or 0):.1f}%, "
          f"max {100 * (foreign['max'] or 0):.1f}% ({foreign['samples']} samples)"
          + ("  VOID: another process used the machine" if foreign["void"] else ""))


if __name__ == "__main__":
    main()
