"""Model directories: tiny seeded models, loading errors, default-model preparation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.common.models import prepare as prepare_mod
from services.common.models.loading import load_causal_lm, resolve_model_dir
from services.common.models.prepare import (
    PREPARED_MARKER,
    SOURCE_GGUF,
    default_model_dir,
    is_prepared,
    prepare_default_model,
)
from services.common.models.tiny import (
    TINY_VOCAB_SIZE,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_config,
    tiny_model_dir,
)

ROUND_TRIP_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\treturn x * 2  # trailing spaces   ",
    "Ünïcödé: café, Straße, 日本語, emoji 🙂🚀, and unseen ŋ ∑ ☃",
    " leading space and\n\nblank lines",
]


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


# ----------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_model_same_seed_gives_identical_weights(tmp_path, arch):
    first = load_file(build_tiny_model(tmp_path / "a", arch=arch, seed=7) / "model.safetensors")
    second = load_file(build_tiny_model(tmp_path / "b", arch=arch, seed=7) / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "c", arch=arch, seed=8) / "model.safetensors")

    assert first.keys() == second.keys() == other.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_tiny_llama_loads_with_expected_config(tiny_root):
    model, tokenizer = load_causal_lm(tiny_model_dir(tiny_root, "llama"), dtype=torch.float32)
    config = model.config

    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (384, 64, 128)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert (config.head_dim, config.max_position_embeddings) == (16, 512)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert len(tokenizer) == TINY_VOCAB_SIZE


def test_tiny_gemma3_mixes_sliding_and_full_attention(tiny_root):
    model, _ = load_causal_lm(tiny_model_dir(tiny_root, "gemma3"), dtype=torch.float32)
    config = model.config

    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert config.model_type == "gemma3_text"
    assert config.sliding_window == 16
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (4, 4, 2)
    assert (config.head_dim, config.query_pre_attn_scalar) == (16, 16)
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_greedy_output_is_not_one_repeated_token(tiny_root, arch):
    model, tokenizer = load_causal_lm(tiny_model_dir(tiny_root, arch), dtype=torch.float32)
    for prompt in ["The quick brown fox", "def fibonacci(n):"]:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=20, do_sample=False, min_new_tokens=20)
        new_tokens = out[0, inputs["input_ids"].shape[1]:].tolist()  # [20]
        assert len(new_tokens) == 20
        assert len(set(new_tokens)) >= 5, new_tokens


def test_tiny_gemma3_prompt_longer_than_sliding_window_runs(tiny_root):
    model, tokenizer = load_causal_lm(tiny_model_dir(tiny_root, "gemma3"), dtype=torch.float32)
    input_ids = tokenizer(ROUND_TRIP_TEXTS[0] * 3, return_tensors="pt")["input_ids"]  # [1, seq]
    assert input_ids.shape[1] > 2 * model.config.sliding_window
    with torch.no_grad():
        logits = model(input_ids).logits  # [1, seq, vocab]
    assert logits.shape == (1, input_ids.shape[1], TINY_VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_tiny_tokenizer_round_trips_and_adds_bos(tiny_root):
    _, tokenizer = load_causal_lm(tiny_model_dir(tiny_root, "llama"), dtype=torch.float32)

    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tiny_tokenizer_is_deterministic():
    first, second = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert first is not second  # fresh objects: callers may mutate theirs


def test_tiny_model_dir_reuses_a_built_directory(tmp_path):
    first = tiny_model_dir(tmp_path, "llama", seed=3)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = tiny_model_dir(tmp_path, "llama", seed=3)

    assert first == second == tmp_path / "tiny-llama-seed3"
    assert (second / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama-seed3"]  # no temp dirs left


def test_tiny_config_overrides():
    config = tiny_config("gemma3", num_hidden_layers=3, sliding_window=8)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.sliding_window == 8
    with pytest.raises(ValueError, match="unknown config overrides"):
        tiny_config("llama", not_a_field=1)
    with pytest.raises(ValueError, match="unknown tiny arch"):
        tiny_config("gpt2")


# ----------------------------------------------------------------------------- loading errors


def test_load_missing_dir_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="specmesh models prepare"):
        load_causal_lm(tmp_path / "nope", dtype=torch.float32)


def test_load_dir_without_config_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(tmp_path, dtype=torch.float32)


def test_load_dir_without_weights_is_file_not_found(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights file"):
        load_causal_lm(tmp_path, dtype=torch.float32)


def test_load_non_causal_lm_is_value_error(tmp_path):
    from transformers import T5Config

    T5Config(num_layers=1, d_model=8, d_ff=8, num_heads=1, d_kv=8).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not a causal LM"):
        load_causal_lm(tmp_path, dtype=torch.float32)


def test_resolve_model_dir_local_path_and_missing(tmp_path, tiny_root):
    built = tiny_model_dir(tiny_root, "llama")
    assert resolve_model_dir(str(built), cache_root=tmp_path) == built
    with pytest.raises(FileNotFoundError, match="no model directory"):
        resolve_model_dir(str(tmp_path / "missing"), cache_root=tmp_path)


# ----------------------------------------------------------------------------- prepare (fast, faked conversion)


def _fake_convert(work: Path, out: Path, progress: bool) -> dict[str, float]:
    out.mkdir()
    for name in prepare_mod._REQUIRED_FILES:
        (out / name).write_text("{}")
    return {"fake": 0.0}


def test_prepare_is_atomic_when_conversion_fails(tmp_path, monkeypatch):
    def failing_convert(work, out, progress):
        _fake_convert(work, out, progress)
        raise RuntimeError("interrupted")

    monkeypatch.setattr(prepare_mod, "_convert", failing_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare_default_model(tmp_path / "gemma", progress=False)
    assert list(tmp_path.iterdir()) == []  # neither a half directory nor a temp directory


def test_prepare_converts_once_and_replaces_half_directories(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(prepare_mod, "_convert", lambda *a: calls.append(1) or _fake_convert(*a))
    model_dir = tmp_path / "gemma"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")  # left by something else: no marker
    assert not is_prepared(model_dir)

    assert prepare_default_model(model_dir, progress=False) == model_dir
    assert prepare_default_model(model_dir, progress=False) == model_dir
    assert calls == [1]
    assert is_prepared(model_dir)
    assert json.loads((model_dir / PREPARED_MARKER).read_text())["format_version"] == prepare_mod.FORMAT_VERSION

    prepare_default_model(model_dir, force=True, progress=False)
    assert calls == [1, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma"]


def test_prepare_removes_temp_dirs_of_killed_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "_convert", _fake_convert)
    stale, fresh = tmp_path / ".gemma.tmp-stale", tmp_path / ".gemma.tmp-fresh"
    stale.mkdir()
    fresh.mkdir()  # could belong to a run still in progress
    os.utime(stale, (0, 0))

    prepare_default_model(tmp_path / "gemma", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".gemma.tmp-fresh", "gemma"]


# ----------------------------------------------------------------------------- the real default model


@pytest.mark.slow
def test_prepared_default_model_loads_plainly(monkeypatch):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = prepare_default_model(default_model_dir(), progress=False)  # reuses the cache
    assert is_prepared(model_dir)
    # The GGUF it came from stays beside it (`--weights gguf` reads its blocks), under one fixed
    # name; loading the directory never goes through it (checked below).
    assert [p.name for p in model_dir.glob("*.gguf")] in ([], [SOURCE_GGUF])
    config_json = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config_json

    def no_gguf(*args, **kwargs):
        raise AssertionError("the prepared directory must load without the GGUF path")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_gguf)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = model.config

    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert config.model_type == "gemma3_text"
    assert (config.num_hidden_layers, config.vocab_size, config.sliding_window) == (18, 262144, 512)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        640, 4, 1, 256)
    assert config.layer_types.count("full_attention") == 3 and config.layer_types[5] == "full_attention"
    assert getattr(config, "quantization_config", None) is None
    assert model.dtype == torch.bfloat16

    ids = tokenizer("The capital of France is")["input_ids"]
    assert ids == [2, 818, 5279, 529, 7001, 563]  # <bos> added automatically
    inputs = tokenizer("Question: What is the capital of France?\nAnswer:", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, inputs["input_ids"].shape[1]:]).strip().startswith("Paris")


@pytest.mark.slow
def test_resolve_default_name_gives_prepared_dir():
    cache_root = default_model_dir().parent
    assert resolve_model_dir("default", cache_root, progress=False) == default_model_dir()
    assert resolve_model_dir("gemma-3-270m", cache_root, progress=False) == default_model_dir()


# ----------------------------------------------------------------------------- HF baseline helper


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_hf_generate_greedy_matches_argmax_loop(tiny_root, arch):
    from benchmarks.hf_baseline import hf_generate_greedy

    model, tokenizer = load_causal_lm(tiny_model_dir(tiny_root, arch), dtype=torch.float32)
    run = hf_generate_greedy(model, tokenizer, "Once upon a time", max_new_tokens=24, ignore_eos=True)

    ids = torch.tensor([run.prompt_ids])  # [1, seq]
    expected = []
    with torch.no_grad():
        for _ in range(24):  # no KV cache: recompute the whole sequence each step
            next_id = int(model(ids).logits[0, -1].argmax())
            expected.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    assert run.prompt_ids[0] == tokenizer.bos_token_id
    assert run.new_tokens == expected
    assert 0 < run.ttft_s <= run.total_s
    assert run.text == tokenizer.decode(expected, skip_special_tokens=True)



def test_a_model_with_attention_soft_capping_is_refused_at_load_with_a_clear_error(tmp_path):
    from services.target.config import EngineConfig
    from services.target.engine.engine import Engine
    model_dir = build_tiny_model(tmp_path / "softcap", arch="gemma3", seed=0, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="soft-capping"):
        Engine.load(EngineConfig(model_dir=model_dir, dtype="float32"))
