"""Hugging Face `generate` greedy baseline: tokens and timing for one prompt.

Reusable: `hf_generate_greedy(model, tokenizer, prompt, max_new_tokens)` returns the
generated token ids with time to first token and decode rate, so later benchmarks can
report their speed as a ratio to this baseline measured in the same run.

    python -m benchmarks.hf_baseline --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer


@dataclass(frozen=True)
class GreedyRun:
    """One greedy `generate` call: token ids and wall-clock timing."""

    prompt_ids: list[int]  # as tokenized, <bos> included when the tokenizer adds it
    new_tokens: list[int]  # generated ids; fewer than max_new_tokens when eos came first
    text: str  # decoded new tokens, special tokens skipped
    ttft_s: float  # call start -> first new token (prefill + first sample)
    total_s: float  # call start -> generate returned

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the whole call, prefill included."""
        return len(self.new_tokens) / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first one: the steady decode rate."""
        decode_s = self.total_s - self.ttft_s
        return (len(self.new_tokens) - 1) / decode_s if len(self.new_tokens) > 1 and decode_s > 0 else 0.0


def hf_generate_greedy(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    ignore_eos: bool = False,
    progress: bool = False,
) -> GreedyRun:
    """Greedy-decode `prompt` with `model.generate`; `ignore_eos` forces exactly max_new_tokens."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    prompt_ids = inputs["input_ids"][0].tolist()  # [prompt_len]
    streamer = _TimingStreamer(max_new_tokens, progress)
    extra = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
            streamer=streamer,
            **extra,
        )  # [1, prompt_len + new]
    total_s = time.perf_counter() - start
    streamer.close()
    new_tokens = out[0, len(prompt_ids):].tolist()
    ttft_s = (streamer.first_token_at - start) if streamer.first_token_at is not None else total_s
    return GreedyRun(
        prompt_ids=prompt_ids,
        new_tokens=new_tokens,
        text=tokenizer.decode(new_tokens, skip_special_tokens=True),
        ttft_s=ttft_s,
        total_s=total_s,
    )


# ----------------------------------------------------------------------------- helpers


class _TimingStreamer(BaseStreamer):
    """Notes when the first new token arrives; advances a tqdm bar per new token."""

    def __init__(self, total: int, progress: bool):
        self.first_token_at: float | None = None
        self._seen_prompt = False
        self._bar = tqdm(total=total, desc="generate", unit="tok", disable=not progress, leave=False)

    def put(self, value: torch.Tensor) -> None:  # value: [1, prompt_len] first, then [1] or [1, 1]
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self._bar.update(value.numel())

    def end(self) -> None:
        pass

    def close(self) -> None:
        self._bar.close()


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DEFAULT_PROMPT = "The history of the printing press begins"


def main(argv: list[str] | None = None) -> None:
    from services.common.models.loading import load_causal_lm, resolve_model_dir
    from services.common.models.prepare import default_cache_root

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (Gemma 3 270M) or a local HF directory")
    parser.add_argument("--cache-root", type=Path, default=default_cache_root())
    parser.add_argument("--prompt", default=_DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stop-at-eos", action="store_true", help="stop early at eos (default: exact count)")
    args = parser.parse_args(argv)

    model_dir = resolve_model_dir(args.model, args.cache_root)
    start = time.perf_counter()
    model, tokenizer = load_causal_lm(model_dir, dtype=_DTYPES[args.dtype], device=args.device)
    load_s = time.perf_counter() - start
    if args.warmup_tokens > 0:
        hf_generate_greedy(model, tokenizer, args.prompt, args.warmup_tokens, ignore_eos=True)
    run = hf_generate_greedy(
        model, tokenizer, args.prompt, args.max_new_tokens, ignore_eos=not args.stop_at_eos, progress=True
    )
    print(f"model        {model_dir} ({type(model).__name__}, {args.dtype}, {args.device}, "
          f"{torch.get_num_threads()} threads)")
    print(f"load         {load_s:.2f} s (model + tokenizer)")
    print(f"prompt       {len(run.prompt_ids)} tokens: {args.prompt!r}")
    print(f"generated    {len(run.new_tokens)} tokens in {run.total_s:.2f} s")
    print(f"ttft         {run.ttft_s * 1000:.0f} ms")
    print(f"throughput   {run.tokens_per_s:.1f} tok/s overall, {run.decode_tokens_per_s:.1f} tok/s decode")
    print(f"text         {run.text!r}")


if __name__ == "__main__":
    main()
