"""Each Llama-family checkpoint served through the mesh (its lean forward) gives Hugging Face
`generate`'s greedy tokens, plain, with prompt lookup and with a draft model."""

from __future__ import annotations

import asyncio

import pytest

from services.target.model.llama_forward import LlamaPagedForward
from tests.e2e.test_generate import hf_greedy
from tests.mesh import collect, request, start_draft, start_mesh

# past the window of 16 within the prompt, and copy-heavy for prompt lookup
PROMPTS = ["1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4", "the cat sat on the mat. the cat sat on the mat. the cat"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from services.common.models.tiny import build_tiny_model
    root = tmp_path_factory.mktemp("llama-family")
    return {arch: build_tiny_model(root / arch, arch=arch, seed=3) for arch in ("qwen2", "qwen3", "mistral")}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("method", ["off", "prompt_lookup", "draft_model"])
async def test_greedy_output_equals_hugging_face_generate(checkpoints, tiny_llama_dir, arch, method):
    model_dir = checkpoints[arch]
    draft = None
    if method != "off":  # the draft model: the tiny Llama (same tokenizer), an imperfect draft
        draft = await start_draft(tiny_llama_dir if method == "draft_model" else None)
    mesh = await start_mesh(model_dir, draft_address=draft.address if draft else "", speculation={
        "speculation_method": method, "speculation_depth": 4})
    try:
        assert isinstance(mesh.engine.runner.lean_forward, LlamaPagedForward)
        results = await asyncio.gather(*(collect(mesh.router_stub, request(p, 20)) for p in PROMPTS))
    finally:
        await mesh.stop()
        if draft:
            await draft.stop(grace=0.5)
    for prompt, (ids, _, _) in zip(PROMPTS, results):
        assert ids == hf_greedy(model_dir, prompt, 20), (arch, method, prompt)
    proposed = sum(last.usage.proposed_tokens for _, _, last in results)
    assert (proposed > 0) == (method != "off"), "speculation verified draft tokens only when asked"


async def test_generic_forward_setting_runs_transformers_modules(checkpoints):
    """`forward generic` (what compare.py --generic measures the lean forward against) serves
    with transformers' own modules and still gives `generate`'s tokens; it cannot be split
    across ranks."""
    from services.target.config import EngineConfig
    model_dir = checkpoints["qwen3"]
    mesh = await start_mesh(model_dir, forward="generic")
    try:
        assert mesh.engine.runner.lean_forward is None
        ids, _, _ = await collect(mesh.router_stub, request(PROMPTS[0], 20))
    finally:
        await mesh.stop()
    assert ids == hf_greedy(model_dir, PROMPTS[0], 20)
    with pytest.raises(ValueError, match="tensor_parallel"):
        EngineConfig(model_dir=model_dir, forward="generic", tensor_parallel=2)
    with pytest.raises(ValueError, match="forward"):
        EngineConfig(model_dir=model_dir, forward="lean")
