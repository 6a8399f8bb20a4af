"""Model directories: prepare the default model, load causal LMs, build tiny test models.

- `prepare_default_model`: packaged Gemma 3 270M GGUF -> cached Hugging Face directory.
- `load_causal_lm` / `resolve_model_dir`: load any local Hugging Face causal LM directory.
- `build_tiny_model` / `tiny_model_dir`: tiny seeded models with an offline tokenizer.
"""

from services.common.models.loading import (
    check_causal_lm_dir,
    load_causal_lm,
    resolve_model_dir,
)
from services.common.models.prepare import (
    DEFAULT_MODEL_ALIASES,
    DEFAULT_MODEL_NAME,
    default_cache_root,
    default_model_dir,
    is_prepared,
    prepare_default_model,
)
from services.common.models.tiny import (
    TINY_ARCHS,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_config,
    tiny_model_dir,
)

__all__ = [
    "DEFAULT_MODEL_ALIASES",
    "DEFAULT_MODEL_NAME",
    "TINY_ARCHS",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "check_causal_lm_dir",
    "default_cache_root",
    "default_model_dir",
    "is_prepared",
    "load_causal_lm",
    "prepare_default_model",
    "resolve_model_dir",
    "tiny_config",
    "tiny_model_dir",
]
