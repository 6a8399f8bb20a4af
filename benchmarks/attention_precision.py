"""How much the CPU attention's precision moves a bf16 model's greedy choices, teacher-forced.

    python benchmarks/attention_precision.py                      # README.md and docs/*.md
    python benchmarks/attention_precision.py --files a.txt b.txt --max-tokens 1500

Runs the engine's forward over each file's first tokens (512-token chunks, logits at every
position) twice: with a float32 KV cache (attention in float32) and with `auto` (a bf16 cache and
bf16 matmul attention where the CPU multiplies bf16 natively), and Hugging Face's bf16 model with
its sdpa and eager attention as the yardstick. Where `auto` weights are specmesh's AVX-512 kernel
with its C++ row ops and the CPU has native bf16, also `onednn` (`--weights bf16`: oneDNN's
linears and torch's ops, transformers' arithmetic). Prints, for each pair, how often the greedy
(argmax) choice agrees and the mean over positions of the largest log-probability difference.
"""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from services.target.engine.block_manager import PrefixMatch
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.model.model_runner_inputs import StepInput

CHUNK = 512


def engine_logits(model_dir: Path, kv_dtype: str, texts: list[str], max_tokens: int,
                  weights: str = "auto") -> list[torch.Tensor]:
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_blocks=2048,
                                      max_num_seqs=4, kv_dtype=kv_dtype, weights=weights))

    def run() -> list[torch.Tensor]:
        out = []
        for t, text in enumerate(texts):
            ids, seq = engine.tokenizer(text).input_ids[:max_tokens], f"text-{t}"
            engine.blocks.admit(seq, PrefixMatch((), (), 0), len(ids), len(ids))
            rows = []
            for s in range(0, len(ids), CHUNK):
                chunk = ids[s:s + CHUNK]
                rows.append(engine.runner.forward(
                    [StepInput(seq, chunk, list(range(s, s + len(chunk))), s, len(chunk))]))
            engine.blocks.release(seq)
            out.append(torch.cat(rows))  # [len(ids), vocab] f32
        return out
    try:
        return engine.run_on_engine_thread(run)
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--files", nargs="+", default=["README.md", *sorted(glob.glob("docs/*.md"))[:1]])
    parser.add_argument("--max-tokens", type=int, default=1500)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    texts = [Path(f).read_text() for f in args.files]
    logits = {kv: engine_logits(model_dir, kv, texts, args.max_tokens) for kv in ("float32", "auto")}
    from services.target.model.linear import native_bf16_cpu, resolve_weight_format
    if native_bf16_cpu() and resolve_weight_format("auto", torch.bfloat16, "cpu") != "bf16":
        # oneDNN's bf16 linears and torch's ops between them: transformers' own arithmetic
        logits["onednn"] = engine_logits(model_dir, "auto", texts, args.max_tokens, weights="bf16")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(t, return_tensors="pt").input_ids[:, :args.max_tokens] for t in texts]
    for impl in ("sdpa", "eager"):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation=impl).eval()
        with torch.inference_mode():
            logits[f"hf {impl}"] = [hf(input_ids=i).logits[0].float() for i in ids]

    def compare(a: str, b: str) -> None:
        agree = n = 0
        gap = 0.0
        for x, y in zip(logits[a], logits[b]):
            agree += int((x.argmax(-1) == y.argmax(-1)).sum())
            n += x.shape[0]
            gap += float((x.log_softmax(-1) - y.log_softmax(-1)).abs().max(-1).values.sum())
        print(f"{a:>8} vs {b:<8}  greedy agreement {agree / n:.4f} over {n} positions, "
              f"mean max |log-prob difference| {gap / n:.4f}")
    print(f"files: {', '.join(args.files)}; engine kv 'float32' = float32 attention, 'auto' = "
          f"{'bf16 matmul attention' if EngineConfig(model_dir=model_dir, dtype='bfloat16').torch_kv_dtype == torch.bfloat16 else 'float32 (no native bf16 here)'}")
    for a, b in (("float32", "auto"), ("float32", "hf sdpa"), ("auto", "hf sdpa"),
                 ("hf sdpa", "hf eager"), ("auto", "hf eager"), ("onednn", "hf eager"), ("onednn", "auto")):
        if a in logits and b in logits:
            compare(a, b)


if __name__ == "__main__":
    main()
