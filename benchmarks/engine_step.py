"""One engine step, in-process: where a prefill or a decode step spends its time.

    python benchmarks/engine_step.py                       # default model, bf16: medians
    python benchmarks/engine_step.py --profile decode1     # plus torch profiler tables

Runs `ModelRunner.forward` on the engine's own thread (no scheduler, sampler or gRPC) over
README.md + DESIGN text:
  * prefill:  a --prefill-tokens prompt in chunks of --chunk tokens, as the scheduler cuts it;
  * decode1:  one sequence (--context tokens of context), one token per step;
  * decode18: 18 sequences of 20 .. 1,380 tokens of context, one token each per step.
Decode rows compute their whole logits, or with --greedy only what their argmax needs (the
argmax screen, as the engine runs plain greedy rows).
Medians of --repeats prefills and --steps decode steps. Machines here are shared and noisy:
compare two variants within one run, or interleave runs, and read a spread of ~10% as noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.model.model_runner_inputs import StepInput
from services.target.model.output_layer import ARGMAX_ONLY

ROOT = Path(__file__).resolve().parents[1]


def corpus_ids(tokenizer, n: int) -> list[int]:
    texts = [ROOT / "README.md", ROOT.parent / "shared" / "DESIGN.md"]
    text = "".join(p.read_text() for p in texts if p.exists())
    ids = tokenizer(text).input_ids
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


class StepBench:
    def __init__(self, engine: Engine, ids: list[int], chunk: int, greedy: bool = False) -> None:
        self.runner, self.blocks, self.ids, self.chunk = engine.runner, engine.runner.blocks, ids, chunk
        self.greedy = greedy and engine.runner.takes_argmax_rows  # decode rows through the argmax screen

    def prefill(self, seq_id: str, tokens: list[int]) -> None:
        self.blocks.reserve(seq_id, len(tokens))
        for start in range(0, len(tokens), self.chunk):
            last = start + self.chunk >= len(tokens)
            self.runner.forward([StepInput.chunk(seq_id, tokens[start:start + self.chunk], start, last)])

    def timed_prefills(self, num_tokens: int, repeats: int) -> list[float]:
        times = []
        for r in range(repeats):
            start = time.perf_counter()
            self.prefill(f"prefill-{r}", self.ids[:num_tokens])
            times.append(time.perf_counter() - start)
            self.blocks.release(f"prefill-{r}")
        return times

    def decode_steps(self, contexts: list[int], steps: int) -> list[float]:
        seqs = []
        for i, n in enumerate(contexts):
            self.prefill(f"decode-{i}", self.ids[:n])
            seqs.append([f"decode-{i}", n])
        times = []
        for _ in range(steps):
            inputs = []
            for seq in seqs:
                self.blocks.reserve(seq[0], seq[1] + 1)
                inputs.append(StepInput.chunk(seq[0], [self.ids[seq[1] % len(self.ids)]], seq[1], True))
                seq[1] += 1
            # greedy: every row read by an argmax alone, as the engine marks plain greedy rows
            subsets = {row: ARGMAX_ONLY for row in range(len(inputs))} if self.greedy else None
            start = time.perf_counter()
            self.runner.forward(inputs, vocab_subsets=subsets)
            times.append(time.perf_counter() - start)
        for seq_id, _ in seqs:
            self.blocks.release(seq_id)
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--weights", default="auto",
                        choices=["auto", "none", "bf16", "bf16-avx512", "gguf", "gguf-bf16", "fp16", "int8"],
                        help="how the linear layers are stored (services/target/model/linear.py)")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="the KV pool, and so attention's precision (services/target/config.py)")
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--context", type=int, default=200, help="decode1's context")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--greedy", action="store_true",
                        help="decode rows read by their argmax alone (the argmax screen, as plain greedy requests)")
    parser.add_argument("--profile", nargs="*", default=[], choices=["prefill", "decode1", "decode18"])
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype=args.dtype, num_blocks=2048,
                                      weights=args.weights, kv_dtype=args.kv_dtype))
    # decode18's longest context is 1,380 tokens, plus its steps
    bench = StepBench(engine, corpus_ids(engine.tokenizer, max(args.prefill_tokens, 1400 + args.steps)), args.chunk,
                      args.greedy)
    runs = {
        "prefill": lambda n: bench.timed_prefills(args.prefill_tokens, n),
        "decode1": lambda n: bench.decode_steps([args.context], n),
        "decode18": lambda n: bench.decode_steps([20 + 80 * i for i in range(18)], n),
    }

    def measure() -> dict[str, list[float]]:
        out = {"prefill": runs["prefill"](args.repeats)}
        return out | {k: runs[k](args.steps)[2:] for k in ("decode1", "decode18")}  # two warm-up steps

    def profile(kind: str) -> str:
        from torch.profiler import profile as torch_profile
        with torch_profile() as prof:
            runs[kind](1 if kind == "prefill" else 20)
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)

    try:
        engine.run_on_engine_thread(lambda: runs["decode1"](3))  # first-call setup is not a step
        result = engine.run_on_engine_thread(measure)
        tables = {kind: engine.run_on_engine_thread(profile, kind) for kind in args.profile}
    finally:
        engine.shutdown()
    print(f"\nmodel={args.model} dtype={args.dtype} weights={args.weights} kv={args.kv_dtype} greedy={bench.greedy} "
          f"threads={torch.get_num_threads()} "
          f"prefill={args.prefill_tokens} tokens in chunks of {args.chunk}, decode1 context={args.context}")
    for kind, times in result.items():
        print(f"{kind:>9}: median {statistics.median(times) * 1000:8.1f} ms   min {min(times) * 1000:8.1f} ms"
              f"   ({len(times)} runs)")
    for kind, table in tables.items():
        print(f"\n{kind} (torch profiler)\n{table}")


if __name__ == "__main__":
    main()
