"""What the feature head borrows from its target, frozen: the token embedding, the final norm
and the LM head, loaded from the target's own directory (never copied into the head's file);
and the target's identity, which a head carries so it is never used with another model."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def target_identity(model_dir: Path) -> str:
    """sha256 hex of the target's config.json (canonical JSON) and of every weights file's own
    sha256 digest (name and digest, sorted by name): equal only for the same model."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    outer = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    weights = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not weights:
        raise FileNotFoundError(f"{model_dir} holds no weights file ({', '.join(_WEIGHT_SUFFIXES)})")
    for path in weights:
        stat = path.stat()
        outer.update(f"{path.name}:{_file_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)}\n".encode())
    return outer.hexdigest()


@dataclass
class TargetParts:
    """The target's frozen embedding, final norm and LM head (the rest of the model is dropped)."""

    embed: nn.Module  # token ids [...] -> [..., hidden] (with the model's own scale, e.g. Gemma's)
    final_norm: nn.Module  # [..., hidden] -> [..., hidden]
    lm_head: nn.Module  # [..., hidden] -> [..., vocab]
    softcap: float | None  # final logit soft-capping, if the model has one
    text_config: object  # the target's text config (sizes for the head)
    identity: str
    vocab_size: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_model(cls, model, model_dir: Path) -> TargetParts:
        """From an already loaded target (`load_causal_lm`): shares its modules."""
        config = model.config.get_text_config(decoder=True)
        decoder = model.get_decoder()
        parts = cls(model.get_input_embeddings(), decoder.norm, model.get_output_embeddings(),
                    getattr(config, "final_logit_softcapping", None) or None, config,
                    target_identity(model_dir), int(model.get_output_embeddings().weight.shape[0]),
                    next(model.parameters()).dtype, next(model.parameters()).device)
        for module in (parts.embed, parts.final_norm, parts.lm_head):
            module.requires_grad_(False)
        return parts

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> TargetParts:
        from services.common.models.loading import load_causal_lm
        model, _ = load_causal_lm(Path(model_dir), dtype, device)
        return cls.from_model(model.eval(), model_dir)

    def features_to_logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., hidden] (after the final norm) -> logits [..., vocab] float32."""
        logits = self.lm_head(features).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of one file (cached per path, size and modification time)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
