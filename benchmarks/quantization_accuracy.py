"""Accuracy of `--weights int8` (and fp16, bf16-avx512) against the model's own bf16 weights.

    python benchmarks/quantization_accuracy.py            # default model, nine prompts, 64 tokens
    python benchmarks/quantization_accuracy.py --weights bf16-avx512   # the kernel's summation order

Teacher-forced over each prompt's bf16 greedy continuation (services/bench/quantization.py):
greedy agreement per position and the mean log-probability gap of the reference's choice.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.anchors.compare import make_prompts  # noqa: E402
from services.common.models.loading import resolve_model_dir  # noqa: E402
from services.target.model.linear import prepack_linears  # noqa: E402
from services.bench.quantization import greedy_agreement  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=9)
    parser.add_argument("--weights", nargs="+", default=["fp16", "int8"], choices=["fp16", "int8", "bf16-avx512"])
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path.home() / ".cache" / "specmesh" / "models")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    sequences, skips = [], []
    with torch.inference_mode():
        for prompt in make_prompts(tokenizer)[:args.prompts]:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = ref.generate(ids, max_new_tokens=args.tokens, do_sample=False)[0].tolist()
            sequences.append(out)
            skips.append(ids.shape[1] - 1)
    for weights in args.weights:
        test = copy.deepcopy(ref)
        prepack_linears(test, weights)
        results = [greedy_agreement(ref, test, [s], skip=k) for s, k in zip(sequences, skips)]
        n = sum(r.positions for r in results)
        agree = sum(r.greedy_agreement * r.positions for r in results) / n
        gap = sum(r.mean_logprob_gap * r.positions for r in results) / n
        with torch.inference_mode():  # free-running: the whole greedy continuation, token for token
            same = sum(test.generate(torch.tensor([s[:k + 1]]), max_new_tokens=args.tokens,
                                     do_sample=False)[0].tolist() == s for s, k in zip(sequences, skips))
        print(f"weights={weights} vs bf16: {n} positions, greedy agreement {agree:.3f}, "
              f"mean log-prob gap {gap:.4f} nats, identical greedy continuations {same}/{len(sequences)}")


if __name__ == "__main__":
    main()
