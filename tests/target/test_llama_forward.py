"""The Llama family's lean forward (Llama 3, Qwen2, Qwen3, Mistral) equals transformers' forward
bit for bit, on every kind of step; other models keep transformers' forward and say so."""

from __future__ import annotations

import logging

import pytest
import torch

from services.target.kernels.select import get_kernels
from services.target.model import lean_forward, llama_forward
from services.target.model.llama_forward import LlamaPagedForward
from tests.target.test_gemma3_forward import _formats, _kernel_available, _run, _runner

# (tiny arch, config overrides): every family, and Llama with Llama 3's RoPE scaling
FAMILIES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """name -> a tiny seeded checkpoint of that family, built on first use."""
    from services.common.models.tiny import build_tiny_model
    built = {}

    def get(name):
        if name not in built:
            arch, overrides = FAMILIES[name]
            built[name] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{name}"), arch=arch, seed=3, **overrides)
        return built[name]
    return get


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype,weights", _formats())
def test_lean_forward_equals_transformers_on_prefill_decode_and_tree_steps(family_dirs, family, dtype, weights):
    """Prefill chunks (one prompt past the window of 16), decode rows and a draft tree: the lean
    forward over fused projections against transformers' forward over the unfused modules, bit
    for bit, for every weight format (torch's ops between the matmuls; the C++ row ops below)."""
    lean = _runner(family_dirs(family), dtype, weights, row_ops=False)
    plain = _runner(family_dirs(family), dtype, weights, fuse=False)
    assert isinstance(lean.lean_forward, LlamaPagedForward) and plain.lean_forward is None
    got, expected = _run(lean), _run(plain)
    assert [g.shape[0] for g in got] == [1 + 12 + 1, 3, 5 + 1]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.skipif(not _kernel_available(), reason="specmesh's CPU kernels do not build here")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_row_ops_run_with_specmeshs_kernel_and_keep_the_logits(family_dirs, family):
    """With specmesh's linear kernel each family's glue runs through the C++ row ops (the same as
    Gemma 3's, the norm's rounding a parameter); forced on beside fbgemm layers they give the same
    greedy tokens and logits within bf16 rounding of the torch ops' (per op: test_cpu_rowops.py)."""
    assert _runner(family_dirs(family), torch.bfloat16, "bf16-avx512").lean_forward.row_ops
    assert not _runner(family_dirs(family), torch.float32, "none").lean_forward.row_ops
    torch_ops = _runner(family_dirs(family), torch.bfloat16, "fp16")
    assert not torch_ops.lean_forward.row_ops
    expected = _run(torch_ops)
    row_ops = _runner(family_dirs(family), torch.bfloat16, "fp16", row_ops=True)
    assert row_ops.lean_forward.silu  # every tiny family's MLP is SwiGLU
    assert row_ops.kernels.cpp_attention  # and attention in C++ where the pool is bf16
    for got, e in zip(_run(row_ops), expected):
        assert torch.equal(got.argmax(-1), e.argmax(-1))
    # The row ops alone (torch's attention): the same logits within bf16 rounding. (The C++
    # attention's own precision, an exp polynomial and another summation order, is checked per
    # kernel in tests/kernels/test_cpu_decode_attention.py.)
    row_ops = _runner(family_dirs(family), torch.bfloat16, "fp16", row_ops=True)
    row_ops.kernels = get_kernels("cpu", cpp_attention=False)
    for got, e in zip(_run(row_ops), expected):
        assert torch.equal(got.argmax(-1), e.argmax(-1))
        torch.testing.assert_close(got, e, atol=0.05, rtol=0.02)


def test_each_family_takes_its_own_parts(family_dirs):
    """Qwen3's q/k norms, Qwen2's and Mistral's sliding windows and Qwen2's biases and tied head
    are read from the modules (the seeded checkpoints' norms and biases are not their defaults)."""
    layers = {name: _runner(family_dirs(name), torch.float32).lean_forward.layers for name in FAMILIES}
    assert all(layer.qk_norm is None for name in FAMILIES if name != "qwen3" for layer in layers[name])
    qwen3 = _runner(family_dirs("qwen3"), torch.float32).model
    q_norm = qwen3.model.layers[0].self_attn.q_norm.weight
    assert not torch.equal(q_norm, torch.ones_like(q_norm))
    assert torch.equal(layers["qwen3"][0].qk_norm[0], q_norm) and layers["qwen3"][0].qk_norm.shape == (4 + 2, 32)
    assert [layer.sliding_window for layer in layers["qwen2"]] == [None, None, 16, 16]
    assert [layer.sliding_window for layer in layers["mistral"]] == [16, 16, 16]
    assert [layer.sliding_window for layer in layers["llama"]] == [None, None]
    qwen2 = _runner(family_dirs("qwen2"), torch.float32)
    assert qwen2.lean_forward.layers[0].qkv_proj.bias is not None
    assert qwen2.model.lm_head.weight.data_ptr() == qwen2.model.model.embed_tokens.weight.data_ptr()


def test_the_sliding_window_changes_the_logits(family_dirs):
    """The window of 16 is applied: without it, the 40-token prompt's last rows attend further
    and the logits change (so the equality above compares windowed attention on both sides)."""
    windowed = _run(_runner(family_dirs("mistral"), torch.float32))
    runner = _runner(family_dirs("mistral"), torch.float32)
    for layer in runner.lean_forward.layers:
        layer.sliding_window = None
    unwindowed = _run(runner)
    assert not torch.equal(windowed[0][0], unwindowed[0][0])  # row 0: the 40-token prompt's last
    assert torch.equal(windowed[0][-1], unwindowed[0][-1])  # the 7-token prompt fits in the window


def test_unsupported_models_keep_transformers_forward_and_say_so(family_dirs, tmp_path, caplog):
    """A MoE (Mixtral) and a Llama with dynamic RoPE take the generic path, logged at load."""
    from services.common.models.tiny import build_tiny_model
    moe = build_tiny_model(tmp_path / "mixtral", arch="mixtral", seed=3)
    dynamic = build_tiny_model(tmp_path / "dynamic", arch="llama", seed=3, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0})
    with caplog.at_level(logging.INFO, logger="services.target.model.lean_forward"):
        for model_dir, name in ((moe, "MixtralForCausalLM"), (dynamic, "LlamaForCausalLM")):
            runner = _runner(model_dir, torch.float32)
            assert runner.lean_forward is None and not lean_forward.supports(runner.model)
            assert f"forward: transformers' modules for {name} (no lean forward" in caplog.text
            assert len(_run(runner)) == 3  # and it serves
        _runner(family_dirs("qwen3"), torch.float32)
    assert "forward: LlamaPagedForward (lean, Qwen3ForCausalLM)" in caplog.text
    assert llama_forward.ARCHITECTURES == ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                           "MistralForCausalLM")
