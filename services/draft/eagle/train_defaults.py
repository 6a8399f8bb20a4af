"""The training flags of `specmesh draft train` (name -> type, help); defaults are TrainConfig's.
Light to import (no torch): the CLI builds its parser from it."""

from __future__ import annotations

DEFAULTS: dict[str, tuple[type, str]] = {
    "num_prompts": (int, "prompts to roll out (default 200)"),
    "max_new_tokens": (int, "tokens the target continues each prompt with (default 96)"),
    "sampled_share": (float, "share of prompts continued by sampling instead of greedily (default 0.5)"),
    "temperature": (float, "sampling temperature of those continuations (default 0.8)"),
    "seed": (int, "seed of the prompt order, the sampled continuations and the training (default 0)"),
    "epochs": (int, "passes over the recorded data (default 2)"),
    "batch_size": (int, "rollouts per optimizer step (default 4)"),
    "lr": (float, "AdamW learning rate (default 1e-3)"),
    "rollout_dtype": (str, "dtype of the engine that writes the continuations, as the target serves (default bfloat16)"),
    "draft_vocab_size": (int, "tokens the head scores, those the target writes most often in the rollouts "
                              "(default 16384; 0 or at least the vocabulary's size = all)"),
    "train_precision": (str, "auto, bfloat16 or float32: the loss's matmuls in bf16 where the CPU has native bf16 "
                               "(default auto)"),
    "ttt_steps": (int, "recursion steps trained on the head's own predictions, EAGLE-3 style (default 3)"),
}
