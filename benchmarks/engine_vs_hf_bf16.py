"""The engine's bf16 greedy continuations against Hugging Face's bf16 `generate`, token for token.

    python benchmarks/engine_vs_hf_bf16.py                    # weights auto and bf16 (oneDNN)
    python benchmarks/engine_vs_hf_bf16.py --weights auto --tokens 128

For the nine prompts of benchmarks/anchors/compare.py, free-running greedy decoding through the
engine (paged KV, chunked prefill, its linear format and ops) and through transformers: how many
continuations are identical, and where the others part. bf16 results depend on summation order,
so two correct bf16 implementations part at near-ties; float32 is token-exact
(tests/target/test_default_model.py).
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.anchors.compare import make_prompts  # noqa: E402
from services.settings import read_settings  # noqa: E402
from services.common.models.loading import resolve_model_dir  # noqa: E402
from services.common.sampling_params import SamplingConfig  # noqa: E402
from services.target.config import EngineConfig  # noqa: E402
from services.target.engine.engine import Engine  # noqa: E402


def engine_greedy(model_dir: Path, weights: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", weights=weights))
    engine.start()
    out = []
    try:
        for i, ids in enumerate(prompts):
            done, got = threading.Event(), []

            def emit(step, got=got, done=done):
                got.extend(step.token_ids)
                if step.finish_reason is not None:
                    done.set()
            engine.submit(f"p{i}", ids, SamplingConfig(max_tokens=tokens), emit)
            assert done.wait(600)
            out.append(got)
    finally:
        engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--weights", nargs="+", default=["auto", "bf16"])
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(p).input_ids for p in make_prompts(tokenizer)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = [hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=args.tokens, do_sample=False)[0, len(ids):].tolist() for ids in prompts]
    for weights in args.weights:
        got = engine_greedy(model_dir, weights, prompts, args.tokens)
        parts = [next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]
        same = sum(p is None and len(g) == len(e) for p, g, e in zip(parts, got, expected))
        print(f"weights={weights}: {same}/{len(prompts)} continuations identical to HF bf16 over {args.tokens} tokens; "
              f"the others part at token {sorted(p for p in parts if p is not None)}")


if __name__ == "__main__":
    main()
