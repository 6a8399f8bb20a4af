"""A head's file: small safetensors of the head's own weights, with its config and the target's
identity in the metadata. Loading checks the identity: a head is never used with another model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.draft.eagle.head import FeatureHead, HeadConfig

FORMAT = "specmesh-feature-head-v1"


class HeadMismatch(ValueError):
    """The head was trained for another target model."""


def save_head(path: Path, head: FeatureHead, target_identity: str, extra: dict | None = None,
              dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes the head's weights (in `dtype`) and metadata atomically; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: (p.detach().to(dtype) if p.is_floating_point() else p.detach()).contiguous().cpu()
               for name, p in head.state_dict().items()}  # the draft vocabulary stays int64
    metadata = {"format": FORMAT, "target_identity": target_identity,
                "head_config": json.dumps(head.config.to_dict()), "extra": json.dumps(extra or {})}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)
    return path


def read_metadata(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a specmesh feature head (format {metadata.get('format')!r}, "
                         f"expected {FORMAT!r})")
    return metadata


def load_head(path: Path, target_identity: str, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> FeatureHead:
    """The head saved at `path`; raises HeadMismatch when it was trained for another target."""
    path = Path(path)
    metadata = read_metadata(path)
    saved_for = metadata.get("target_identity", "")
    if saved_for != target_identity:
        raise HeadMismatch(f"feature head {path} was trained for another target model (identity "
                           f"{saved_for[:16]}..., this target is {target_identity[:16]}...); train one "
                           "for this model with `specmesh draft train --model <this model>`")
    head = FeatureHead(HeadConfig(**json.loads(metadata["head_config"])))
    state = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            state[name] = f.get_tensor(name)
    head.load_state_dict(state)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
