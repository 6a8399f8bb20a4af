"""Packed linear layers (services/target/model/linear.py): what they compute, and where they apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.target.model.linear import (
    Int8Linear,
    PackedLinearBF16,
    PackedLinearFP16,
    int8_scales,
    native_bf16_cpu,
    prepack_linears,
    resolve_weight_format,
)


def _linear(out_features: int, in_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    return layer.to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_fp16_packed_equals_float32_product_of_the_same_weights(rows, bias):
    layer = _linear(48, 40, bias, seed=rows)
    x = torch.randn(2, rows, 40).to(torch.bfloat16)  # [batch, rows, in]
    packed = PackedLinearFP16(layer)
    w = layer.weight.float()  # bf16 values are exact in fp16 here (|w| > 6.1e-5 or 0)
    expected = x.float() @ w.T + (layer.bias.float() if bias else 0)
    out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, rows, 48)
    torch.testing.assert_close(out, expected.to(torch.bfloat16), atol=0, rtol=0.008)
    assert PackedLinearFP16(layer, out_dtype=torch.float32)(x).dtype == torch.float32


needs_native_bf16 = pytest.mark.skipif(not native_bf16_cpu(), reason="CPU without native bf16")


@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_packed_is_bit_identical_to_torch_bf16_linear(rows, bias):
    # The packed layout changes where the weights sit, not the arithmetic: a bf16 model's
    # outputs stay exactly those of its own nn.Linear (and so of Hugging Face's).
    layer = _linear(300, 64, bias, seed=rows)
    x = torch.randn(2, rows, 64).to(torch.bfloat16)  # [batch, rows, in]
    out = PackedLinearBF16(layer)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, rows, 300)
    assert torch.equal(out, layer(x))
    as_f32 = PackedLinearBF16(layer, out_dtype=torch.float32)(x)
    assert as_f32.dtype == torch.float32 and torch.equal(as_f32, layer(x).float())


def test_bf16_packing_is_refused_without_native_bf16(monkeypatch):
    import services.target.model.linear as linear
    monkeypatch.setattr(linear, "native_bf16_cpu", lambda: False)
    monkeypatch.setattr(linear.cpu_linear, "available", lambda: False)  # nor the AVX-512 kernel
    assert resolve_weight_format("auto", torch.bfloat16, "cpu") == "fp16"
    with pytest.raises(ValueError, match="native bf16"):
        prepack_linears(nn.Sequential(nn.Linear(4, 4)), "bf16")


def test_int8_weights_are_per_channel_symmetric():
    w = torch.tensor([[0.5, -1.27, 0.0], [2.54, 1.0, -0.01]])  # [out=2, in=3]
    assert int8_scales(w).tolist() == pytest.approx([0.01, 0.02])
    layer = nn.Linear(3, 2, bias=False)
    layer.weight.data = w
    x = torch.tensor([[1.0, 1.0, 1.0]])
    # Activations are quantized dynamically too (one scale per call): close, not exact.
    torch.testing.assert_close(Int8Linear(layer)(x), x @ w.T, atol=0.03, rtol=0.02)


def test_auto_format_packs_16_bit_models_on_the_cpu_only():
    from services.target.kernels import cpu_linear
    if cpu_linear.available():
        bf16_format = "bf16-avx512"  # specmesh's kernel wherever it builds (tests/target/test_cpu_linear.py)
    else:
        bf16_format = "bf16" if native_bf16_cpu() else "fp16"
    assert resolve_weight_format("auto", torch.bfloat16, "cpu") == bf16_format
    assert resolve_weight_format("auto", torch.float16, "cpu") == "fp16"
    assert resolve_weight_format("auto", torch.float32, "cpu") == "none"
    assert resolve_weight_format("auto", torch.bfloat16, "cuda") == "none"
    assert resolve_weight_format("int8", torch.float32, "cpu") == "int8"
    with pytest.raises(ValueError):
        resolve_weight_format("int4", torch.float32, "cpu")


def test_prepack_replaces_every_linear_and_keeps_a_tied_embedding():
    from services.common.models.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", arch="llama", seed=1)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    embedding = model.get_input_embeddings().weight.clone()
    num_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert prepack_linears(model, "fp16") == num_linear
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinearFP16) and model.lm_head.out_dtype == torch.float32
    assert torch.equal(model.get_input_embeddings().weight, embedding)
