"""Accuracy cost of the host tier's FP8 copies (`kv_cold_precision`) on long prompts, teacher-forced.

    python benchmarks/kv_precision.py              # default model, README.md, docs/kernels.md, docs/observability.md
    python benchmarks/kv_precision.py --record     # and record it for kv_cold_precision auto

Texts are disjoint windows of the files (up to --windows per file). For each, its first --prompt-tokens tokens are prefilled into the engine's pool; then the
next --continuation tokens of the text are read teacher-forced (logits at every position) twice:
with the prompt's KV as computed, and after every prompt block is stored in the engine's host tier
and restored from it, through the model runner's own tier moves, with `kv_cold_precision fp8`: the
blocks from --after-tokens on go through FP8 and come back dequantized, the first ones stay exact.
Scored as benchmarks/quantization_accuracy.py scores int8 weights (services/bench/kv_precision.py):
how often the greedy (argmax) choice agrees, and the mean log-probability the reference's choice
loses. `--record` writes the result beside the policy (services/target/engine/kv_cold_measured.json),
where `auto` reads it: FP8 under pressure only while it is within the bound stated there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.bench.kv_precision import restored_agreement  # noqa: E402
from services.common.models.loading import resolve_model_dir  # noqa: E402
from services.settings import read_settings  # noqa: E402
from services.target.config import EngineConfig  # noqa: E402
from services.target.engine.engine import Engine  # noqa: E402
from services.target.engine.kv_precision import (  # noqa: E402
    MAX_LOGPROB_GAP, MIN_AGREEMENT, MeasuredCost, record_measurement)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--files", nargs="+", default=["README.md", "docs/kernels.md", "docs/observability.md"])
    parser.add_argument("--windows", type=int, default=4, help="most windows taken from one file")
    parser.add_argument("--prompt-tokens", type=int, default=1536, help="a multiple of the block size (16)")
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--after-tokens", type=int, default=256, help="kv_cold_after_tokens")
    parser.add_argument("--kv-dtype", default="auto", help="the pool's dtype (auto: bf16 with native bf16)")
    parser.add_argument("--record", action="store_true", help="record it for kv_cold_precision auto")
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_blocks=256, max_num_seqs=1,
                                      kv_dtype=args.kv_dtype, kv_cold_precision="fp8",
                                      kv_cold_after_tokens=args.after_tokens))
    try:
        need = args.prompt_tokens + args.continuation
        texts = []
        bos = [engine.tokenizer.bos_token_id] if engine.tokenizer.bos_token_id is not None else []
        for f in args.files:  # each window starts as a prompt does (with BOS where the model has one)
            ids = engine.tokenizer(Path(f).read_text(), add_special_tokens=False).input_ids
            size = need - len(bos)
            texts += [bos + ids[w * size:(w + 1) * size] for w in range(min(args.windows, len(ids) // size))]
        if not texts:
            raise SystemExit(f"no file has {need} tokens")
        result = engine.run_on_engine_thread(restored_agreement, engine, texts, args.prompt_tokens)
        kv_dtype = str(engine.config.torch_kv_dtype)
    finally:
        engine.shutdown()
    cost = MeasuredCost(result.greedy_agreement, result.mean_logprob_gap, result.positions, args.after_tokens,
                        kv_dtype)
    print(f"kv_cold_precision fp8 vs exact KV ({kv_dtype} pool), {len(texts)} texts, prompts of "
          f"{args.prompt_tokens} tokens (FP8 from token {args.after_tokens}), {args.continuation} teacher-forced "
          f"tokens each: {cost.positions} positions, greedy agreement {cost.greedy_agreement:.4f}, mean log-prob gap "
          f"{cost.mean_logprob_gap:.4f} nats; bound (auto): >= {MIN_AGREEMENT} and <= {MAX_LOGPROB_GAP}: "
          f"{'within' if cost.within_bound else 'OUTSIDE'}")
    if args.record:
        record_measurement(model_dir, cost, {"command": " ".join(["python benchmarks/kv_precision.py", *sys.argv[1:]]),
                                             "texts": len(texts), "prompt_tokens": args.prompt_tokens})
        print("recorded for kv_cold_precision auto")


if __name__ == "__main__":
    main()
