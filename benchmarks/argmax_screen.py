"""The argmax screen on the default model: how many tokens it leaves to the exact pass, and what a
step's output layer costs with it and without it, by rows a step.

    python benchmarks/argmax_screen.py                  # default model, bf16-avx512 weights
    python benchmarks/argmax_screen.py --steps 8 --repeats 15

Captures the output layer's input rows of real decode steps (18 sequences of 20 .. 1,380 tokens of
README and DESIGN text, one token each a step, on the engine's own thread), then, on those rows:
  * candidates: per row, the tokens whose bound reaches the best one (the exact pass's columns),
    with the weights in blocks of 32 and of 64 k (median, 90th percentile, largest);
  * timings (medians of --repeats): the whole layer, the int8 pass alone on the VPDPBUSD loop and,
    where the CPU has AMX-INT8, on tiles, and the screen as the engine calls it, at 1 .. 18 rows.
Machines here are shared and noisy: compare columns within one run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.engine_step import StepBench, corpus_ids
from benchmarks.linear_formats import median_ms
from services.common.models.loading import resolve_model_dir
from services.settings import read_settings
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.kernels import argmax_screen
from services.target.model import output_layer


def captured_rows(engine: Engine, steps: int) -> tuple[torch.Tensor, output_layer.OutputLayer]:
    """[18 * steps, hidden] output-layer input rows of real decode steps, and the layer."""
    rows, layers = [], []
    call = output_layer.OutputLayer.__call__

    def capture(self, h, vocab_subsets=None):
        if h.shape[0] == 18:
            rows.append(h.clone())
            layers.append(self)
        return call(self, h, vocab_subsets)

    bench = StepBench(engine, corpus_ids(engine.tokenizer, 1400 + steps), 512)
    output_layer.OutputLayer.__call__ = capture
    try:
        engine.run_on_engine_thread(lambda: bench.decode_steps([20 + 80 * i for i in range(18)], steps))
    finally:
        output_layer.OutputLayer.__call__ = call
    return torch.cat(rows), layers[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--weights", default="bf16-avx512", choices=["bf16-avx512", "gguf"])
    parser.add_argument("--steps", type=int, default=8, help="decode steps captured (18 rows each)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 12, 16, 18])
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    engine = Engine.load(EngineConfig(model_dir=model_dir, num_blocks=2048, weights=args.weights))
    try:
        h, layer = captured_rows(engine, args.steps)
        if layer.screen is None:
            raise SystemExit(f"the screen does not run here: {argmax_screen.unavailable_reason(h.shape[1])}")
        x = h.to(torch.bfloat16).contiguous()
        n, k = layer.screen.weights.out_features, layer.screen.weights.in_features
        print(f"{x.shape[0]} rows of {args.steps} decode steps; output layer {n} x {k}; "
              f"AMX-INT8 pass: {argmax_screen.amx_int8()}; screen max rows a step: {output_layer.screen_max_rows()}")
        for block in (argmax_screen.BLOCK, argmax_screen.WIDE_BLOCK):
            w = layer.screen.weights if block == layer.screen.weights.block else \
                argmax_screen.quantize_weights(layer.screen.weight_rows, n, k, block=block)
            counts = sorted(argmax_screen.bounds(x[i:i + 1], w)[2].numel() for i in range(x.shape[0]))
            print(f"candidates a row, blocks of {block} k: median {counts[len(counts) // 2]}, "
                  f"90th percentile {counts[int(0.9 * len(counts))]}, largest {counts[-1]} "
                  f"(int8 copy {w.nbytes() / 1e6:.0f} MB)")
        w = layer.screen.weights

        def timed_rows():
            out = []
            for m in args.rows:
                rows = x[:m]
                out.append((m, median_ms(lambda: layer.lm_head(rows), args.repeats),
                            median_ms(lambda: argmax_screen.bounds(rows, w, amx=False), args.repeats),
                            median_ms(lambda: argmax_screen.bounds(rows, w, amx=True), args.repeats)
                            if argmax_screen.amx_int8() else None,
                            median_ms(lambda: layer.screen(rows), args.repeats)))
            return out

        print(f"\nms a call (medians of {args.repeats}), blocks of {w.block} k:")
        print(f"{'rows':>5} {'whole layer':>12} {'int8 loop':>10} {'int8 tiles':>11} {'screen':>8}")
        for m, whole, loop, tiles, screen in engine.run_on_engine_thread(timed_rows):
            print(f"{m:>5} {whole:>12.2f} {loop:>10.2f} {'-' if tiles is None else f'{tiles:.2f}':>11} {screen:>8.2f}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
