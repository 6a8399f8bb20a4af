"""Per-token cost of log-probabilities (top-5) and of each penalty, relative to plain sampling.

    python -m benchmarks.sampling_cost                  # default model, bf16, one stream
    python -m benchmarks.sampling_cost --tokens 64 --rounds 5

Two measurements, side by side in one run:
  * decode: one request at a time through the in-process engine (no gRPC), each variant in
    turn, for --rounds interleaved rounds; the time per output token after the first
    (TPOT) of each request, median over rounds, and its ratio to plain sampling.
  * rows: the sampling step alone (logits processing, sampling, log-probabilities) on one
    row of the model's vocabulary, median microseconds per token, with the same ratio
    expressed as a share of the plain decode step measured above.
Plain sampling is temperature 0.8, top-p 0.95, seeded. The machine is shared: read spreads
of ~10% in the decode ratios as noise; the row timings are the steadier number.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from services.bench.foreign_cpu import ForeignCpu
from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.model.logits_processors import LogitsProcessor
from services.target.model.sample_rows import sample_rows
from services.target.model.sampler import make_generator

PLAIN = dict(temperature=0.8, top_p=0.95, seed=1)
VARIANTS = {
    "plain": {},
    "logprobs-top5": dict(logprobs=True, top_logprobs=5),
    "presence": dict(presence_penalty=0.5),
    "frequency": dict(frequency_penalty=0.5),
    "repetition": dict(repetition_penalty=1.2),
    "logit_bias-20": dict(logit_bias=tuple((1000 + 37 * i, 1.5) for i in range(20))),
    "min_tokens": dict(min_tokens=16),
    "all": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                logit_bias=((1000, 1.5),), logprobs=True, top_logprobs=5),
}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def decode_tpot(engine: Engine, prompt_ids: list[int], config: SamplingConfig, request_id: str) -> float:
    """Seconds per output token after the first, for one request alone in the engine."""
    times, done = [], threading.Event()

    def emit(out) -> None:
        if out.token_ids:
            times.append(time.perf_counter())
        if out.finish_reason is not None or out.error is not None:
            done.set()
    engine.submit(request_id, prompt_ids, config, emit)
    done.wait()
    return (times[-1] - times[0]) / (len(times) - 1)


def row_micros(vocab: int, config: SamplingConfig, history: list[int], eos: frozenset[int],
               repeats: int) -> float:
    """Median microseconds of the sampling step on one [1, vocab] row."""
    gen = make_generator(0, "cpu")
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 4  # [1, vocab]
    processor = LogitsProcessor.for_request(config, eos, len(history) // 2)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample_rows(logits, [config], [gen], [processor], [history])
        out.append(time.perf_counter() - start)
    return statistics.median(out) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--row-repeats", type=int, default=200)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype=args.dtype, enable_prefix_caching=False))
    engine.start()
    cpu = ForeignCpu().__enter__()  # CPU used by anything outside this process meanwhile
    try:
        prompt_ids = engine.tokenize(PROMPT)
        configs = {name: SamplingConfig(max_tokens=args.tokens, **PLAIN, **extra)
                   for name, extra in VARIANTS.items()}
        tpot = {name: [] for name in VARIANTS}
        decode_tpot(engine, prompt_ids, configs["plain"], "warm-up")
        for r in range(args.rounds):
            for name, config in configs.items():
                tpot[name].append(decode_tpot(engine, prompt_ids, config, f"{name}-{r}"))
                print(f"round {r} {name}: {tpot[name][-1] * 1000:.1f} ms/token", file=sys.stderr, flush=True)
        history = list(range(200, 200 + 2 * args.tokens))  # prompt + output of the row bench
        rows = {name: engine.run_on_engine_thread(row_micros, engine.spec.vocab_size, config, history,
                                                  engine.spec.eos_token_ids, args.row_repeats)
                for name, config in configs.items()}
    finally:
        cpu.__exit__(None, None, None)
        engine.shutdown()
    foreign = cpu.share()
    print(f"foreign CPU while measuring: median {100 * (foreign['median'] or 0):.1f}%, "
          f"max {100 * (foreign['max'] or 0):.1f}% ({foreign['samples']} samples)"
          + ("  VOID: another process used the machine" if foreign["void"] else ""))
    base = statistics.median(tpot["plain"])
    print(f"model {model_dir.name} {args.dtype}, vocab {engine.spec.vocab_size}, {args.tokens} tokens, "
          f"{args.rounds} rounds; plain TPOT {base * 1000:.2f} ms")
    print(f"{'variant':16} {'TPOT ms':>8} {'ratio':>6} {'row us':>8} {'row +us':>8} {'row share':>9}")
    for name in VARIANTS:
        t = statistics.median(tpot[name])
        extra = rows[name] - rows["plain"]
        print(f"{name:16} {t * 1000:8.2f} {t / base:6.3f} {rows[name]:8.0f} {extra:8.0f} "
              f"{100 * extra / (base * 1e6):8.2f}%")


if __name__ == "__main__":
    main()
