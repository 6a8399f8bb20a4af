"""Whether a prompt's greedy output depends on how its prefill is split into engine steps.

Runs the first turns of kv_host_tier's conversations (~470 tokens each) on two engines that
differ only in `max_batched_tokens` (one chunk per prompt against chunks of --small tokens),
one request at a time, and counts the prompts whose greedy answers are the same. The linear
kernel is batch-invariant (a row's outputs never depend on the other rows); a difference
comes from the attention, whose torch matmuls are shaped by the chunk (keys up to the chunk's
end, float32 route from FLOAT32_ROUTE_ROWS query rows), so their float32 sums run in another
order and a bf16 rounding can flip a near-tie. This is why the multi-turn comparison's answers
can part at a first turn, where no tier is involved.

    python benchmarks/prefill_chunking.py [--prompts 12 --small 96 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.kv_host_tier import conversation_prompts, run
from services.common.env import read_settings
from services.common.models.loading import resolve_model_dir
from services.target.config import EngineConfig
from services.target.engine.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--small", type=int, default=96, help="max_batched_tokens of the chunked side")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    outputs = {}
    for budget in (512, args.small):
        engine = Engine.load(EngineConfig(model_dir=model_dir, dtype=args.dtype, num_blocks=256,
                                          max_batched_tokens=budget))
        engine.start()
        try:
            convs = conversation_prompts(engine.tokenizer, args.prompts, 1)
            outputs[budget] = [run(engine, conv[0] + conv[1], args.tokens)[1] for conv in convs]
        finally:
            engine.shutdown()
    same = sum(a == b for a, b in zip(outputs[512], outputs[args.small]))
    print(f"{args.dtype}: same greedy answers ({args.tokens} tokens) with one chunk per prompt and with "
          f"{args.small}-token chunks: {same} of {args.prompts}")


if __name__ == "__main__":
    main()
