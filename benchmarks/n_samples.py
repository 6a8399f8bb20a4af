"""n samples sharing one prefill vs n separate requests, on the default model: prompt tokens
computed (prefill work) and time until every sample has its first token. One run, side by side.

    python -m benchmarks.n_samples            # n = 8, a 1,500-token prompt

The separate requests run concurrently, each under its own tenant salt, so none reuses another's
prefix-cache blocks (what n requests pay on different replicas or tenants); a third row runs them
under one salt, where the prefix cache already shares the blocks computed by the time each request
is admitted. Issue 25's goal: at least 5x less prefill work and 3x lower time to all first tokens.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from services.bench.foreign_cpu import ForeignCpu
from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine


class _FirstTokens:
    """Waits for the first token of `expected` streams (keyed by request id and sample index)."""

    def __init__(self, expected: int, requests: int) -> None:
        self.expected, self.requests, self.first, self.ended = expected, requests, {}, 0
        self.done, self.all_first = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def emit_for(self, request_id: str):
        def emit(out) -> None:
            with self._lock:
                key = (request_id, out.index)
                if out.token_ids and key not in self.first:
                    self.first[key] = time.perf_counter()
                    if len(self.first) == self.expected:
                        self.all_first.set()
                if out.finish_reason is not None and out.ends_request:
                    self.ended += 1
                    if out.error is not None or self.ended == self.requests:
                        self.done.set()
        return emit


def run(engine: Engine, prompt_ids: list[int], n: int, together: bool, shared_salt: bool,
        max_tokens: int, tag: str) -> tuple[int, float, float]:
    """(prompt tokens computed, seconds to all first tokens, seconds to the end)."""
    waiter = _FirstTokens(n, 1 if together else n)
    before = engine.stats().prompt_tokens_computed
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0, seed=1234)
    start = time.perf_counter()
    if together:
        engine.submit(f"{tag}-n", prompt_ids, sampling, waiter.emit_for(f"{tag}-n"), n=n)
    else:
        for i in range(n):
            rid = f"{tag}-{i}"
            engine.submit(rid, prompt_ids, SamplingConfig(max_tokens=max_tokens, temperature=1.0, seed=1234 + i),
                          waiter.emit_for(rid), tenant_salt="bench" if shared_salt else f"{tag}-tenant-{i}")
    waiter.all_first.wait()
    first = time.perf_counter() - start
    waiter.done.wait()
    return engine.stats().prompt_tokens_computed - before, first, time.perf_counter() - start


def prompt_of(tokenizer, num_tokens: int, salt: str) -> list[int]:
    words = [f"Record {salt}-{i}: the parcel for house {i % 53} left depot {i % 17}." for i in range(num_tokens)]
    return tokenizer(" ".join(words)).input_ids[:num_tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_blocks=2048,
                                      max_batched_tokens=512, max_num_seqs=max(32, args.n)))
    engine.start()
    cpu = ForeignCpu().__enter__()  # CPU used by anything outside this process meanwhile
    try:
        warm = prompt_of(engine.tokenizer, 64, "warm")
        run(engine, warm, 2, True, False, 2, "warm")  # first-call costs out of the measurement
        rows = []
        for label, together, shared in (("n samples, one request", True, False),
                                        ("separate requests, own salts", False, False),
                                        ("separate requests, one salt", False, True)):
            prompt = prompt_of(engine.tokenizer, args.prompt_tokens, label)  # fresh: no earlier hit
            rows.append((label, *run(engine, prompt, args.n, together, shared, args.max_tokens, label[:8])))
    finally:
        cpu.__exit__(None, None, None)
        engine.shutdown()
    foreign = cpu.share()
    print(f"foreign CPU while measuring: median {100 * (foreign['median'] or 0):.1f}%, "
          f"max {100 * (foreign['max'] or 0):.1f}% ({foreign['samples']} samples)"
          + ("  VOID: another process used the machine" if foreign["void"] else ""))
    print(f"n = {args.n}, prompt {args.prompt_tokens} tokens, max_tokens {args.max_tokens}, "
          f"{model_dir.name}, bf16, max_batched_tokens 512")
    print(f"{'':32} {'prompt tokens computed':>24} {'all first tokens (s)':>22} {'end (s)':>9}")
    for label, computed, first, end in rows:
        print(f"{label:32} {computed:>24} {first:>22.2f} {end:>9.2f}")
    _, computed, first, _ = rows[0]
    for label, other_computed, other_first, _ in rows[1:]:
        print(f"vs {label}: {other_computed / computed:.1f}x less prefill work, "
              f"{other_first / first:.1f}x lower time to all first tokens")


if __name__ == "__main__":
    main()
