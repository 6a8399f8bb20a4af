"""The argmax screen on the default model: how many tokens it leaves to the exact pass, and what a
step's output layer costs with it and without it, by rows a step.

    python -m benchmarks.argmax_screen                  # default model, bf16-avx512 weights
    python -m benchmarks.argmax_screen --steps 8 --repeats 15 --narrow-bits 7 6

Captures the output layer's input rows of real decode steps (18 sequences of 20 .. 1,380 tokens of
README and DESIGN text, one token each a step, on the engine's own thread), then, on those rows:
  * candidates: per row, the tokens whose bound reaches the best one (the exact pass's columns),
    with the weights in blocks of 32 and of 64 k (median, 90th percentile, largest);
  * with --narrow-bits B [B ...]: the same count were the weights quantized to B < 8 bits (a
    torch estimate of the bound: |x| |w - w_hat| + |x - x_hat| |w_hat|, without the float32
    slack): what a narrower copy, fewer bytes a token, would leave to the exact pass;
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


def narrow_candidates(x: torch.Tensor, weight_rows, n: int, bits: int, block: int) -> list[int]:
    """Per row of x [M, K] bf16: the tokens whose bound reaches the row's best lower bound less the
    tie margin, were the layer's weights quantized to `bits` (symmetric, one scale per `block` k)
    and the rows to int8 per 64 k (32 where K is no multiple of 64) as the screen does. A torch estimate, for sizing a narrower copy."""
    w = torch.cat([weight_rows(torch.arange(i, min(n, i + 32768))) for i in range(0, n, 32768)]).float()
    k = w.shape[1]
    qmax = 2 ** (bits - 1) - 1
    wb = w.view(n, k // block, block)
    s = wb.abs().amax(-1, keepdim=True) / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    w_hat = (torch.round(wb / s).clamp(-qmax, qmax) * s).view(n, k)  # [N, K]
    err, norm = (w - w_hat).norm(dim=1), w_hat.norm(dim=1)  # [N]
    xf = x.float()
    row_block = argmax_screen.WIDE_BLOCK if k % argmax_screen.WIDE_BLOCK == 0 else argmax_screen.BLOCK
    xb = xf.view(x.shape[0], k // row_block, row_block)
    t = xb.abs().amax(-1, keepdim=True) / 127
    t = torch.where(t > 0, t, torch.ones_like(t))
    x_hat = (torch.round(xb / t).clamp(-127, 127) * t).view(x.shape[0], k)
    counts = []
    for row, row_hat in zip(xf, x_hat):
        approx = w_hat @ row_hat  # [N]
        bound = row.norm() * err + (row - row_hat).norm() * norm
        best = (approx - bound).max()
        counts.append(int((approx + bound >= best - best.abs() * argmax_screen._TIE_MARGIN).sum()))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--weights", default="bf16-avx512", choices=["bf16-avx512", "gguf"])
    parser.add_argument("--steps", type=int, default=8, help="decode steps captured (18 rows each)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 12, 16, 18])
    parser.add_argument("--narrow-bits", type=int, nargs="*", default=[], choices=[4, 5, 6, 7],
                        help="also estimate the candidates of a copy at these bits a weight")
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
        for bits in args.narrow_bits:
            for block in (argmax_screen.BLOCK, argmax_screen.WIDE_BLOCK):
                counts = sorted(narrow_candidates(x, layer.screen.weight_rows, n, bits, block))
                print(f"estimate, {bits}-bit weights in blocks of {block} k ({bits * k / 8 + 2 * k / block:.0f} "
                      f"bytes a column against the int8 copy's {k + 2 * k / argmax_screen.WIDE_BLOCK:.0f}): "
                      f"median {counts[len(counts) // 2]}, 90th percentile {counts[int(0.9 * len(counts))]}, "
                      f"largest {counts[-1]}, rows over an eighth of the vocabulary "
                      f"{sum(c > n // 8 for c in counts)} of {len(counts)}")
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
