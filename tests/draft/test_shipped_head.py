"""The feature head that ships for the default model (slow: the default Gemma 3 270M): it was
trained for exactly that model (its identity is the default model's hash), its training record
sits beside it, and greedy output with it equals the target alone token for token, in float32,
with its drafts accepted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.common.models.prepare import prepare_default_model
from services.draft.eagle.checkpoint import load_head, read_metadata
from services.draft.eagle.shipped import resolve_eagle_head
from services.draft.eagle.target_parts import target_identity
from services.settings import read_settings
from tests.target.test_eagle_serving import _ids, _run

pytestmark = pytest.mark.slow

PROMPTS = ["What are some good ways to spend a rainy weekend at home?",
           "Write a short story about a clockmaker who builds a clock that runs backwards."]


@pytest.fixture(scope="module")
def default_dir() -> Path:
    return prepare_default_model(Path(read_settings().model_cache).expanduser() / "gemma-3-270m", progress=False)


def test_the_shipped_head_is_the_default_models_and_says_how_it_was_made(default_dir):
    head = resolve_eagle_head("auto", "default")
    assert head is not None and head.stat().st_size < 20 << 20  # small: the head's own bf16 weights
    identity = target_identity(default_dir)
    assert read_metadata(head)["target_identity"] == identity
    record = json.loads(head.with_name(head.name + ".json").read_text())
    assert record["target_identity"] == identity
    assert "specmesh draft train" in record["command"] and record["seed"] == 0
    loaded = load_head(head, identity)  # refused for any other model (tests/draft/test_eagle_head.py)
    assert 0 < len(loaded.draft_vocab) <= 16384


def test_greedy_output_with_the_shipped_head_equals_the_target_alone(default_dir):
    head = resolve_eagle_head("auto", "default")
    chat = [f"<start_of_turn>user\n{p}<end_of_turn>\n<start_of_turn>model\n" for p in PROMPTS]
    alone, _ = asyncio.run(_run(default_dir, head, chat, 32))
    samples, _ = asyncio.run(_run(default_dir, head, chat, 32, (4, 12)))
    assert _ids(samples) == _ids(alone)
    accepted = sum(u.accepted_tokens for _, u in samples)
    passes = sum(u.verify_passes for _, u in samples)
    print(f"shipped head, float32: {accepted} drafts accepted in {passes} verify passes")
    assert accepted > passes // 2  # it drafts what the target writes, not only runs
