"""Prefix caching on the default model: TTFT with a cached 2,000-token prefix vs cold,
and the overhead of prefix caching when nothing hits. One run, side by side.

    python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from tqdm import tqdm

from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine


def ttft(engine: Engine, prompt_ids: list[int], max_tokens: int = 1) -> tuple[float, float, int]:
    """(time to first token, total time, cached prompt tokens) of one request."""
    first, done, info = [], threading.Event(), {}

    def emit(out):
        if out.token_ids and not first:
            first.append(time.perf_counter())
        if out.finish_reason is not None:
            info["cached"] = out.cached_prompt_tokens
            done.set()
    start = time.perf_counter()
    engine.submit(f"bench-{time.monotonic_ns()}", prompt_ids, SamplingConfig(max_tokens=max_tokens), emit)
    done.wait()
    return first[0] - start, time.perf_counter() - start, info["cached"]


def document(tokenizer, num_tokens: int, salt: int) -> list[int]:
    words = [f"item{salt}-{i} is stored on shelf {i % 37} in room {i % 11}." for i in range(num_tokens)]
    ids = tokenizer(" ".join(words)).input_ids
    return ids[:num_tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    config = dict(model_dir=model_dir, dtype="bfloat16", num_blocks=2048, max_batched_tokens=512)
    cached = Engine.load(EngineConfig(**config))
    plain = Engine.load(EngineConfig(**config, enable_prefix_caching=False))
    cached.start()
    plain.start()
    tok = cached.tokenizer
    question = tok(" Question: which shelf holds item 5? Answer:").input_ids[1:]
    cold, hot = [], []
    for r in tqdm(range(args.repeats), desc="cached prefix vs cold"):
        prefix = document(tok, args.prefix_tokens, salt=r)
        t_cold, _, c0 = ttft(cached, prefix + question)
        t_hot, _, c1 = ttft(cached, prefix + question[:-1] + [question[-1]])
        assert c0 == 0 and c1 > 0, (c0, c1)
        cold.append(t_cold)
        hot.append(t_hot)
    with_cache, without = [], []
    for r in tqdm(range(args.repeats * 2), desc="no-hit overhead"):
        prompt = document(tok, 1000, salt=1000 + r)  # unique: never hits
        # Alternate the order so drift on a shared machine hits both sides.
        pair = [(cached, with_cache), (plain, without)]
        for engine, out in (pair if r % 2 == 0 else pair[::-1]):
            out.append(ttft(engine, prompt, max_tokens=16)[1])
    cached.shutdown()
    plain.shutdown()
    c, h = statistics.median(cold), statistics.median(hot)
    w, wo = statistics.median(with_cache), statistics.median(without)
    print(f"\nmodel={args.model} bf16, prefix={args.prefix_tokens} tokens, repeats={args.repeats}")
    print(f"TTFT cold            {c * 1000:8.1f} ms")
    print(f"TTFT cached prefix   {h * 1000:8.1f} ms   speedup {c / h:.1f}x")
    print(f"no-hit request (1000-token prompt + 16 tokens): with prefix caching {w * 1000:.1f} ms, "
          f"without {wo * 1000:.1f} ms, overhead {100 * (w / wo - 1):+.1f}%")


if __name__ == "__main__":
    main()
