"""Feature heads that ship with specmesh (services/draft/eagle/heads/): for the default model, so
eagle runs on a fresh machine without training. Beside each head, `<head>.json` records the
command, seed and training cost that produced it.

The `eagle_head` setting: "auto" (the default) takes the shipped head of the target `model` where
one ships, else none; "none" (or empty) turns eagle off; anything else is a head file.
"""

from __future__ import annotations

from pathlib import Path

HEADS_DIR = Path(__file__).resolve().parent / "heads"
SHIPPED = {"default": "gemma-3-270m.eagle.safetensors"}  # mesh `model` -> head file in HEADS_DIR


def shipped_head(model: str) -> Path | None:
    """The head shipped for the mesh `model` (None when none ships or its file is missing)."""
    name = SHIPPED.get(model)
    path = HEADS_DIR / name if name else None
    return path if path is not None and path.is_file() else None


def resolve_eagle_head(setting: str, model: str) -> Path | None:
    """The head file the `eagle_head` setting names for `model` (see the module docstring)."""
    value = setting.strip()
    if value.lower() in ("", "none", "off"):
        return None
    if value.lower() == "auto":
        return shipped_head(model)
    return Path(value).expanduser()
