"""A feature head trained for a tiny target in about a second (shared by the eagle tests)."""

from __future__ import annotations

from pathlib import Path

from services.draft.eagle.train import TrainConfig, TrainResult, train_head


def tiny_train_config(model_dir: Path, out: Path, **overrides) -> TrainConfig:
    values = dict(num_prompts=16, max_new_tokens=24, epochs=6, batch_size=4, lr=3e-3, checkpoint_every=5,
                  seed=0, rollout_dtype="float32")  # the tests serve the tiny target in float32
    return TrainConfig(model_dir=model_dir, out=out, **{**values, **overrides})


def train_tiny_head(model_dir: Path, out: Path, **overrides) -> TrainResult:
    return train_head(tiny_train_config(model_dir, out, **overrides), progress=False)
