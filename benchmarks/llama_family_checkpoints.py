"""Random-weight checkpoints of published Llama-family shapes, for measuring speed offline.

    python benchmarks/llama_family_checkpoints.py qwen2.5-0.5b      # prints the directory
    python benchmarks/anchors/compare.py --model "$(python benchmarks/llama_family_checkpoints.py qwen2.5-0.5b)" \
        --skip vllm hf speculation --rounds 1

Each shape's config values are typed in from its published config.json (nothing is fetched);
weights ~ N(0, initializer_range) from a seeded generator, bf16 safetensors, with the tiny
offline byte-level tokenizer (services/common/models/tiny.py, 384 tokens: it fits every
vocabulary here; the embedding and LM head keep the published vocabulary's size, which is what
costs). Speed depends on the shapes, not the values; greedy output of random weights is noise,
so the benchmark counts tokens, not text. Built once under ~/.cache/specmesh/shapes/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "qwen2.5-0.5b": ("Qwen2Config", dict(  # Qwen/Qwen2.5-0.5B: 494M parameters
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=True,
        use_sliding_window=False, hidden_act="silu", initializer_range=0.02)),
    "llama-3.2-1b": ("LlamaConfig", dict(  # meta-llama/Llama-3.2-1B: 1.24B parameters
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, hidden_act="silu", initializer_range=0.02)),
    "qwen3-0.6b": ("Qwen3Config", dict(  # Qwen/Qwen3-0.6B: 596M parameters
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, hidden_act="silu", initializer_range=0.02)),
}


def build(shape: str, out_root: Path, seed: int = 0) -> Path:
    """The checkpoint directory of `shape` (built on first use)."""
    import torch
    import transformers

    from services.common.models.tiny import build_tiny_tokenizer

    out = out_root / shape
    if (out / "config.json").exists():
        return out
    config_cls, values = SHAPES[shape]
    tokenizer = build_tiny_tokenizer()
    # bos/eos/pad: the tiny tokenizer's (a random model picks eos about once in 150k tokens)
    config = getattr(transformers, config_cls)(**values, bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * config.initializer_range)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache" / "specmesh" / "shapes")
    args = parser.parse_args()
    print(build(args.shape, args.out))


if __name__ == "__main__":
    main()
