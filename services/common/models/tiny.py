"""Tiny seeded causal LMs for tests, saved as ordinary Hugging Face directories.

`build_tiny_model` writes config + safetensors + tokenizer, so tests run the real loading
path (`load_causal_lm`). Everything is offline and deterministic:

- tokenizer: a byte-level BPE (`TINY_VOCAB_SIZE` tokens: 4 specials, 256 bytes, merges)
  trained on the built-in `_CORPUS`; it adds `<bos>` like Gemma's tokenizer does and
  round-trips any text (byte level, so there is no unknown token in practice).
- weights: every matrix ~ N(0, initializer_range) drawn from a `torch.Generator` seeded
  with `seed`, in sorted parameter-name order; vectors (norms) keep their defaults. The
  large std (0.2) makes greedy output vary instead of repeating one token.

Architectures: "llama" (2 layers, full attention) and "gemma3" (4 layers mixing
sliding-window and full attention, sliding_window=16), both with an untied LM head; the rest
of the Llama family for its lean forward (services/target/model/llama_forward.py): "qwen2"
(q/k/v biases, tied embeddings, its last 2 of 4 layers sliding, window 16, GQA 4:1), "qwen3"
(q/k norms, head_dim 32 so heads * head_dim != hidden), "mistral" (every layer sliding, window
16, GQA 1:1); and "mixtral" (a MoE, which keeps transformers' forward). These four also seed
their vectors (norm weights 1 + N(0, 0.1), biases N(0, std)), so a norm weight or a bias that a
forward forgot changes the logits.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ("llama", "gemma3", "qwen2", "qwen3", "mistral", "mixtral")
TINY_VOCAB_SIZE = 384
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3
TINY_MARKER = "specmesh-tiny.json"
CHAT_SPECIAL_TOKENS = ("<start_of_turn>", "<end_of_turn>")  # ids 384, 385 with chat=True

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False,
    ),
    "gemma3": dict(
        num_hidden_layers=4,
        sliding_window=16,
        sliding_window_pattern=2,  # only recorded as `_sliding_window_pattern`; layer_types rules
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        query_pre_attn_scalar=16,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        # Untied, unlike the real Gemma 3: with random tied weights the residual stream's
        # scaled embedding dominates and greedy output repeats one token forever.
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        num_hidden_layers=4,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=2,  # layers 2 and 3 slide
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        num_hidden_layers=3,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False,
    ),
}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "gemma3": "Gemma3TextConfig", "qwen2": "Qwen2Config",
                   "qwen3": "Qwen3Config", "mistral": "MistralConfig", "mixtral": "MixtralConfig"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
_SEED_VECTORS = ("qwen2", "qwen3", "mistral", "mixtral")  # llama and gemma3 keep their files as they were


def tiny_config(arch: str = "llama", **overrides):
    """The tiny config of `arch` with `overrides` applied (unknown keys are an error)."""
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS}")
    config_cls = getattr(transformers, _CONFIG_CLASSES[arch])
    known = set(config_cls().to_dict()) | {"rope_parameters", "layer_types"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown config overrides for {arch}: {unknown}")
    kwargs = {**_COMMON, **_ARCH_DEFAULTS[arch], "vocab_size": TINY_VOCAB_SIZE, **overrides}
    if arch == "gemma3" and "num_hidden_layers" in overrides and "layer_types" not in overrides:
        kwargs["layer_types"] = _alternating_layer_types(overrides["num_hidden_layers"])
    config = config_cls(**kwargs)
    config.architectures = [_ARCHITECTURES[arch]]
    return config


def build_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0, chat: bool = False,
                     **overrides) -> Path:
    """Write a tiny seeded model of `arch` to `out_dir` (atomically) and return `out_dir`.

    Same (arch, seed, overrides) -> identical files' weights. `overrides` go to the config
    (e.g. `num_hidden_layers=3`, `sliding_window=8`, `initializer_range=0.02`). `chat=True`
    adds Gemma 3's chat template with its `<start_of_turn>` / `<end_of_turn>` special tokens
    (ids TINY_VOCAB_SIZE, TINY_VOCAB_SIZE + 1; the vocabulary grows by two) and stops
    generation at `<end_of_turn>` as Gemma's generation config does.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if chat:
        overrides.setdefault("vocab_size", TINY_VOCAB_SIZE + len(CHAT_SPECIAL_TOKENS))
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _seed_weights(model, seed, config.initializer_range, vectors=arch in _SEED_VECTORS)
    model.generation_config.pad_token_id = config.pad_token_id
    tokenizer = build_tiny_tokenizer(chat=chat)
    if chat:
        model.generation_config.eos_token_id = [config.eos_token_id,
                                                tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer's {len(tokenizer)}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        marker = {"arch": arch, "seed": seed, "overrides": overrides, **({"chat": True} if chat else {})}
        (work / TINY_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True, default=str) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(work, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


def tiny_model_dir(tmp_root: Path, arch: str = "llama", seed: int = 0) -> Path:
    """`tmp_root/tiny-{arch}-seed{seed}`, built on first use and reused afterwards."""
    out_dir = Path(tmp_root) / f"tiny-{arch}-seed{seed}"
    try:
        marker = json.loads((out_dir / TINY_MARKER).read_text())
        if marker == {"arch": arch, "seed": seed, "overrides": {}}:
            return out_dir
    except (OSError, ValueError):
        pass
    return build_tiny_model(out_dir, arch=arch, seed=seed)


def build_tiny_tokenizer(chat: bool = False):
    """Byte-level BPE trained deterministically on `_CORPUS`, as a PreTrainedTokenizerFast;
    `chat=True` adds Gemma 3's chat template and turn tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=_COMMON["max_position_embeddings"],
    )
    if chat:
        from services.common.models.chat_templates import GEMMA3_CHAT_TEMPLATE
        tokenizer.add_tokens(list(CHAT_SPECIAL_TOKENS), special_tokens=True)
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


# ----------------------------------------------------------------------------- helpers


def _seed_weights(model: torch.nn.Module, seed: int, std: float, vectors: bool = False) -> None:
    """Overwrite every matrix with N(0, std) from one seeded generator; keep vectors, or with
    `vectors` draw them too: norm weights 1 + N(0, 0.1), biases N(0, std)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif vectors and name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif vectors and "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.1)


@lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    return tok.to_str()


def _alternating_layer_types(num_layers: int) -> list[str]:
    return ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)]


_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.
Speculative decoding lets a small draft model propose tokens that a large target verifies.
The target accepts the longest prefix it agrees with and adds one bonus token.
Paged attention stores keys and values in fixed-size blocks shared by reference count.
A prefix cache reuses the blocks of a prompt that was already seen by another request.
The router picks a replica with the longest cached prefix, then the lowest load.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10):
    print(i, fibonacci(i))
class Block:
    def __init__(self, block_id, size):
        self.block_id = block_id
        self.ref_count = 0
Once upon a time there was a little robot who loved to count tokens.
It counted one, two, three, four, five, six, seven, eight, nine, ten.
Then it counted again, because counting is what little robots do best.
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 3.14159 2.71828
Punctuation and symbols: , . ; : ! ? ( ) [ ] { } < > = + - * / % & | ^ ~ @ # $ _ " '
Ünïcödé text: café, naïve, résumé, Straße, 日本語, 中文, русский, ελληνικά, emoji 🙂🚀.
{"model": "tiny", "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16}
SELECT id, name FROM users WHERE tenant = 'a' ORDER BY id LIMIT 10;
"""
