"""Engine vs Hugging Face `generate` on the same model, side by side in one run.

    python benchmarks/engine_throughput.py                 # single stream, default model, bf16
    python benchmarks/engine_throughput.py --streams 1 4 16 --tokens 64

For each concurrency N it reports aggregate greedy tokens/s of
  * the specmesh engine with N concurrent requests (continuous batching),
  * Hugging Face `generate` run sequentially over the same N prompts,
  * Hugging Face `generate` on the N prompts as one left-padded batch,
and the ratios. Machines here are shared and noisy: compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when to use one.",
    "List ten facts about the planet Mars.",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "What are the main causes of the French Revolution?",
    "Summarize the plot of Hamlet in a paragraph.",
    "Give me a recipe for pancakes.",
]


def prompts_for(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def limits_for(n: int, max_tokens: int, mixed: bool) -> list[int]:
    """Per-request max_tokens: all equal, or (--mixed) a quarter, half, three quarters, all."""
    return [max_tokens * (1 + i % 4) // 4 if mixed else max_tokens for i in range(n)]


def run_engine(engine: Engine, tokenizer, prompts: list[str], max_tokens: list[int]) -> tuple[int, float]:
    done = threading.Semaphore(0)
    counts = [0] * len(prompts)

    def emitter(i):
        def emit(out):
            counts[i] += len(out.token_ids)
            if out.finish_reason is not None:
                done.release()
        return emit
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(f"bench-{time.monotonic_ns()}-{i}", tokenizer(prompt).input_ids,
                      SamplingConfig(max_tokens=max_tokens[i]), emitter(i))
    for _ in prompts:
        done.acquire()
    return sum(counts), time.perf_counter() - start


def run_hf_sequential(model, tokenizer, prompts: list[str], max_tokens: list[int]) -> tuple[int, float]:
    total, start = 0, time.perf_counter()
    for prompt, limit in zip(prompts, max_tokens):
        ids = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=limit, do_sample=False)
        total += out.shape[1] - ids.input_ids.shape[1]
    return total, time.perf_counter() - start


def run_hf_batch(model, tokenizer, prompts: list[str], max_tokens: list[int]) -> tuple[int, float]:
    """One padded batch runs to the largest limit; only each request's own tokens count."""
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    out = model.generate(**batch, max_new_tokens=max(max_tokens), do_sample=False)
    elapsed = time.perf_counter() - start
    new = out[:, batch.input_ids.shape[1]:]
    pad = tokenizer.pad_token_id
    useful = sum(min(int((row != pad).sum()), limit) for row, limit in zip(new, max_tokens))
    return useful, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--no-hf-batch", action="store_true")
    parser.add_argument("--mixed", action="store_true",
                        help="requests ask for 1/4, 1/2, 3/4 and all of --tokens (a ragged workload)")
    parser.add_argument("--weights", default="auto", help="the engine's weight format (SPECMESH_WEIGHTS)")
    parser.add_argument("--kernels", default="auto", help="the engine's kernel backend (SPECMESH_KERNELS)")
    args = parser.parse_args()
    settings = read_settings()
    model_dir = resolve_model_dir(args.model, Path(settings.model_cache).expanduser())
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype=args.dtype, num_blocks=2048,
                                      max_num_seqs=max(args.streams), weights=args.weights,
                                      kernels=args.kernels))
    # Hugging Face runs on the engine's thread too: one OpenMP team, no contention between them.
    on_thread = engine.run_on_engine_thread
    hf = on_thread(lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval())
    engine.start()
    run_engine(engine, tokenizer, prompts_for(1), [4])  # warm-up
    on_thread(run_hf_sequential, hf, tokenizer, prompts_for(1), [4])
    rows = []
    for n in tqdm(args.streams, desc="concurrency levels"):
        prompts, limits = prompts_for(n), limits_for(n, args.tokens, args.mixed)
        e_tok, e_s = run_engine(engine, tokenizer, prompts, limits)
        s_tok, s_s = on_thread(run_hf_sequential, hf, tokenizer, prompts, limits)
        b_tok, b_s = ((0, float("nan")) if args.no_hf_batch or n == 1
                      else on_thread(run_hf_batch, hf, tokenizer, prompts, limits))
        rows.append((n, e_tok / e_s, s_tok / s_s, b_tok / b_s if b_tok else float("nan")))
    engine.shutdown()
    print(f"\nmodel={args.model} dtype={args.dtype} weights={args.weights} kernels={args.kernels} "
          f"max_tokens={args.tokens} mixed={args.mixed} threads={torch.get_num_threads()}")
    print(f"{'streams':>7} {'engine tok/s':>12} {'HF seq tok/s':>12} {'HF batch tok/s':>14} "
          f"{'vs seq':>7} {'vs batch':>8}")
    for n, e, s, b in rows:
        print(f"{n:>7} {e:>12.1f} {s:>12.1f} {b:>14.1f} {e / s:>6.2f}x {e / b if b == b else float('nan'):>7.2f}x")


if __name__ == "__main__":
    main()
