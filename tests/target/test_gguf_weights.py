"""`--weights gguf`: a model prepared from a GGUF file serves the file's blocks, and its logits equal
`--weights bf16-avx512`'s (the blocks dequantized to bf16, as the preparation does) bit for bit, on
prefill chunks, decode rows and verify trees; the tied embedding is looked up in the same blocks."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, dequantize, quantize
from safetensors.torch import load_file, save_file

from services.common.models import build_tiny_model
from services.common.models.prepare import _LAYER_PARTS, SOURCE_GGUF
from services.target.kernels import cpu_gguf_linear, cpu_linear
from services.target.model import linear
from services.target.model.gguf_weights import GGUFLinear, choose_decode_path

from tests.target.test_gemma3_forward import _run, _runner
from tests.target.test_gguf_linear import _blocks

needs_kernel = pytest.mark.skipif(not cpu_gguf_linear.available(), reason=f"{cpu_gguf_linear.unavailable_reason()}")

# Per GGUF tensor kind, the block types of layers 0, 1, 2, 3: the default model's mix (Q4_K_M)
_LAYER_TYPES = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": ("Q8_0", "Q5_0", "Q6_K", "Q8_0"),
                "attn_output": "Q4_K", "ffn_gate": "Q5_0", "ffn_up": "Q5_0",
                "ffn_down": ("Q6_K", "Q4_K", "Q4_K", "Q6_K")}


@pytest.fixture(scope="module")
def gguf_gemma_dir(tmp_path_factory):
    """A tiny Gemma 3 (tied embedding, K multiples of 256 for the K-quants) whose linear weights and
    embedding are GGUF blocks: source.gguf holds them, model.safetensors their bf16 values."""
    out = build_tiny_model(tmp_path_factory.mktemp("gguf") / "tiny-gemma3-gguf", "gemma3", seed=3,
                           hidden_size=256, intermediate_size=512, head_dim=64, query_pre_attn_scalar=64,
                           tie_word_embeddings=True)
    state = load_file(out / "model.safetensors")
    hf_to_gguf = {v: k for k, v in _LAYER_PARTS.items()}
    writer = GGUFWriter(out / SOURCE_GGUF, "gemma3")
    for i, (name, weight) in enumerate(sorted(state.items())):
        if name == "model.embed_tokens.weight":
            gguf_name, type_name = "token_embd.weight", "Q8_0"
        elif name.endswith("_proj.weight"):
            _, _, layer, *part, _ = name.split(".")
            kind = hf_to_gguf[".".join(part)]
            types = _LAYER_TYPES[kind]
            gguf_name, type_name = f"blk.{layer}.{kind}.weight", types if isinstance(types, str) else types[int(layer)]
        else:
            continue
        qtype = GGMLQuantizationType[type_name]
        if type_name in ("Q8_0", "Q5_0"):
            raw = quantize(weight.float().numpy(), qtype)
        else:  # gguf has no K-quant quantizer: random blocks
            raw = _blocks(type_name, *weight.shape, seed=100 + i)
        writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
        dequantized = np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32)
        state[name] = torch.from_numpy(dequantized).to(torch.bfloat16)  # what prepare.py stores
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@needs_kernel
@pytest.mark.parametrize("weights", ["gguf", "gguf-bf16"])
def test_gguf_logits_equal_bf16_avx512_on_prefill_decode_and_tree_steps(gguf_gemma_dir, weights):
    gguf = _runner(gguf_gemma_dir, torch.bfloat16, weights)
    assert isinstance(gguf.model.lm_head, GGUFLinear) and gguf.lean_forward.embed_rows is not None
    assert (gguf.model.lm_head.panels is not None) == (weights == "gguf-bf16")
    assert isinstance(gguf.lean_forward.layers[0].down_proj.__self__, GGUFLinear)  # its matmul_rows (direct_rows)
    expected = _run(_runner(gguf_gemma_dir, torch.bfloat16, "bf16-avx512"))
    for got, want in zip(_run(gguf), expected):
        assert torch.isfinite(want).all()
        assert torch.equal(got, want)


@needs_kernel
def test_a_gguf_that_is_not_the_source_is_refused(gguf_gemma_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other", "gemma3", seed=4, hidden_size=256, intermediate_size=512,
                             head_dim=64, query_pre_attn_scalar=64, tie_word_embeddings=True)
    (other / SOURCE_GGUF).symlink_to(gguf_gemma_dir / SOURCE_GGUF)
    with pytest.raises(ValueError, match="not the loaded model's weights"):
        _runner(other, torch.bfloat16, "gguf")


def test_gguf_needs_a_model_that_kept_its_gguf(tmp_path):
    with pytest.raises(ValueError, match="prepared from a GGUF"):
        linear.resolve_weight_format("gguf", torch.bfloat16, "cpu", None)


def test_without_avx512_bf16_gguf_falls_back_with_a_log_line(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(cpu_gguf_linear, "unavailable_reason", lambda: "the CPU lacks AVX512-BF16 (test)")
    with caplog.at_level(logging.WARNING, logger="services.target.model.linear"):
        fmt = linear.resolve_weight_format("gguf", torch.bfloat16, "cpu", tmp_path / SOURCE_GGUF)
    assert fmt != "gguf"
    assert "cannot run here (the CPU lacks AVX512-BF16 (test))" in caplog.text


@needs_kernel
def test_gguf_bf16_multiplies_many_rows_on_the_panels_and_few_on_the_blocks(gguf_gemma_dir, monkeypatch):
    runner = _runner(gguf_gemma_dir, torch.bfloat16, "gguf-bf16")
    layer = runner.lean_forward.layers[0].down_proj.__self__
    calls = []
    for module, name in ((cpu_linear, "bf16_linear"), (cpu_gguf_linear, "gguf_linear")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    blocks_only = GGUFLinear(layer.packed)
    layer.block_rows = GGUFLinear.DECODE_ROWS  # as where the blocks measured faster at one row (choose_decode_path)
    for rows in (1, GGUFLinear.DECODE_ROWS, GGUFLinear.DECODE_ROWS + 1, 40):
        x = torch.randn(rows, layer.in_features).to(torch.bfloat16)
        calls.clear()
        got = layer.matmul_rows(x)
        want_path = "bf16_linear" if rows > GGUFLinear.DECODE_ROWS else "gguf_linear"
        assert calls == [want_path], rows
        assert torch.equal(got, blocks_only.matmul_rows(x))  # the same bits on either path
    layer.block_rows = 0  # a machine where the panels measured faster at one row (choose_decode_path)
    x = torch.randn(1, layer.in_features).to(torch.bfloat16)
    calls.clear()
    assert torch.equal(layer.matmul_rows(x), blocks_only.matmul_rows(x)) and calls == ["bf16_linear", "gguf_linear"]


@needs_kernel
def test_gguf_bf16_decode_rows_take_the_layout_measured_faster_here(gguf_gemma_dir):
    runner = _runner(gguf_gemma_dir, torch.bfloat16, "gguf-bf16")
    layers = [m for m in runner.model.modules() if isinstance(m, GGUFLinear) and m is not runner.model.lm_head]
    blocks, panels = choose_decode_path(layers, rounds=3)
    assert blocks > 0 and panels > 0
    assert {layer.block_rows for layer in layers} == {GGUFLinear.DECODE_ROWS if blocks <= panels else 0}
    assert runner.model.lm_head.block_rows == GGUFLinear.DECODE_ROWS  # the output layer keeps its blocks


def test_auto_serves_a_model_prepared_from_a_gguf_with_its_blocks_where_the_kernel_runs(gguf_gemma_dir,
                                                                                      monkeypatch):
    source = gguf_gemma_dir / SOURCE_GGUF
    monkeypatch.setattr(cpu_gguf_linear, "auto_takes_blocks", lambda: True)
    assert linear.resolve_weight_format("auto", torch.bfloat16, "cpu", source) == "gguf-bf16"
    assert linear.resolve_weight_format("auto", torch.float32, "cpu", source) == "none"  # bf16 blocks only
    monkeypatch.setattr(cpu_linear, "available", lambda: True)
    monkeypatch.setattr(cpu_gguf_linear, "auto_takes_blocks", lambda: False)  # AVX2 or no AVX512-BF16: bf16
    assert linear.resolve_weight_format("auto", torch.bfloat16, "cpu", source) == "bf16-avx512"


def test_auto_takes_the_blocks_only_where_they_multiply_with_vdpbf16ps(monkeypatch):
    """On AVX2 the blocks serve `--weights gguf` (half the bytes) but lose to bf16 at one row, so `auto`
    leaves them; with VDPBF16PS `auto` takes them."""
    monkeypatch.setattr(cpu_gguf_linear, "available", lambda: True)
    monkeypatch.setattr(cpu_gguf_linear, "bf16_dot_instruction", lambda: False)
    assert not cpu_gguf_linear.auto_takes_blocks()
    monkeypatch.setattr(cpu_gguf_linear, "bf16_dot_instruction", lambda: True)
    assert cpu_gguf_linear.auto_takes_blocks()


@needs_kernel
def test_auto_loads_the_gguf_blocks_of_a_model_that_kept_its_gguf(gguf_gemma_dir):
    runner = _runner(gguf_gemma_dir, torch.bfloat16, "auto")
    if not cpu_gguf_linear.auto_takes_blocks():  # AVX2: the bf16 kernel, faster there at one row
        assert not isinstance(runner.model.lm_head, GGUFLinear)
        return
    assert isinstance(runner.model.lm_head, GGUFLinear) and runner.model.lm_head.panels is not None
    assert runner.lean_forward.embed_rows is not None  # the tied embedding looked up in the blocks
