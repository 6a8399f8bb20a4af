"""Load a local Hugging Face causal LM directory (model + tokenizer) for the target or draft.

`resolve_model_dir` turns a model name or path into a directory: the names "default" and
"gemma-3-270m" mean the prepared default model (prepared on demand, see `prepare.py`);
anything else is a local path. `load_causal_lm` loads a directory with transformers and
fails early, with a message that says what to do, when the directory is missing or does
not hold a causal LM. Nothing is fetched from a model hub (`local_files_only=True`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from services.common.models.prepare import (
    DEFAULT_MODEL_ALIASES,
    DEFAULT_MODEL_NAME,
    prepare_default_model,
)

_PREPARE_HINT = (
    "run `specmesh models prepare` to convert the default model, "
    "or pass a local Hugging Face causal LM directory"
)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_causal_lm(
    model_dir: Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the causal LM and tokenizer in `model_dir`, in eval mode on `device`, its parameters
    frozen: what serving derives from them outside inference mode (a quantized copy, packed
    panels) then keeps no autograd graph (one such graph held ~8 GB per target process).

    Raises FileNotFoundError when the directory, its config, weights or tokenizer files
    are missing, and ValueError when its config is not a causal LM.
    """
    model_dir = Path(model_dir).expanduser()
    check_causal_lm_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    model.to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer


def resolve_model_dir(name_or_path: str, cache_root: Path, progress: bool = True) -> Path:
    """Map "default" / "gemma-3-270m" to the prepared default model, else a local path.

    The default model is prepared (converted once) on demand under
    `cache_root / "gemma-3-270m"`. A local path must exist.
    """
    if name_or_path in DEFAULT_MODEL_ALIASES:
        return prepare_default_model(Path(cache_root) / DEFAULT_MODEL_NAME, progress=progress)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"no model directory at {str(path)!r}; use 'default' for Gemma 3 270M ({_PREPARE_HINT})"
        )
    return path


def check_causal_lm_dir(model_dir: Path) -> None:
    """Raise FileNotFoundError / ValueError unless `model_dir` looks like a causal LM directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist; {_PREPARE_HINT}")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} has no config.json, so it is not a Hugging Face "
                                f"model directory; {_PREPARE_HINT}")
    _require_any(model_dir, _WEIGHT_FILES, "weights")
    _require_any(model_dir, _TOKENIZER_FILES, "tokenizer")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{str(model_dir)!r} has an unreadable config.json ({exc}); {_PREPARE_HINT}") from exc
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{str(model_dir)!r} holds a {config.model_type!r} model, which is not a causal LM; "
                         f"{_PREPARE_HINT}")


def _require_any(model_dir: Path, names: tuple[str, ...], what: str) -> None:
    if not any((model_dir / name).is_file() for name in names):
        raise FileNotFoundError(f"{str(model_dir)!r} has no {what} file (one of {', '.join(names)}); "
                                f"{_PREPARE_HINT}")
