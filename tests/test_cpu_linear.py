"""The AVX-512 bf16 linear kernel (services/target/kernels/cpu_linear.cpp) against exact references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.target import linear
from services.target.kernels import cpu_linear

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason=f"{cpu_linear.unavailable_reason()}")


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cpu_linear.bf16_linear(x, cpu_linear.pack(w), w.shape[0])


def _sequential_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in plain torch: float32 sums over k = 0 .. K-1 in order, then bf16.

    Each bf16 x bf16 product is exact in float32, so a fused multiply-add rounds exactly as this
    add does, and the kernel must match it bit for bit.
    """
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])  # [M, N] f32
    for k in range(x.shape[1]):
        acc += xf[:, k:k + 1] * wf[:, k]
    return acc.to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 97])  # every microtile, past the 96-row pass
@pytest.mark.parametrize("n,k", [(37, 200), (128, 33), (5, 1)])  # a part panel, whole panels, one column
def test_kernel_equals_float32_sums_in_k_order_bit_for_bit(rows, n, k):
    x, w = _bf16(rows, k, seed=rows), _bf16(n, k, seed=n + k, scale=0.05)
    y = _linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert torch.equal(y, _sequential_reference(x, w))


@needs_kernel
def test_a_rows_outputs_do_not_depend_on_the_other_rows_of_the_call():
    x, w = _bf16(40, 640, seed=7), _bf16(300, 640, seed=8, scale=0.05)
    panels = cpu_linear.pack(w)
    alone = torch.cat([cpu_linear.bf16_linear(x[i:i + 1], panels, 300) for i in range(40)])
    for rows in (2, 3, 5, 6, 11, 12, 40):  # each microtile shape the kernel picks
        assert torch.equal(cpu_linear.bf16_linear(x[:rows], panels, 300), alone[:rows])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 11, 512])
def test_kernel_differs_from_torch_bf16_linear_by_at_most_one_rounding_step(rows):
    # Same products, same float32 accumulation, another summation order: an output may land on
    # the other side of a bf16 rounding boundary, never further.
    x, w = _bf16(rows, 1024, seed=1), _bf16(640, 1024, seed=2, scale=0.05)
    ours, theirs = _linear(x, w).float(), torch.nn.functional.linear(x, w).float()
    step = torch.maximum(ours.abs(), theirs.abs()) * 2.0**-7  # one bf16 step (8 significant bits)
    summation = 2 * x.shape[1] * 2.0**-24 * (x.float().abs() @ w.float().abs().T)  # both orders' error
    assert bool(((ours - theirs).abs() <= step + summation).all())
    assert (ours != theirs).float().mean().item() < 0.01


@needs_kernel
def test_kernel_reads_strided_rows_and_refuses_bad_shapes():
    x = _bf16(6, 128, seed=3)[::2]  # [3, 128], not contiguous
    w = _bf16(20, 128, seed=4)
    assert torch.equal(_linear(x, w), _linear(x.contiguous(), w))
    assert _linear(x[:0], w).shape == (0, 20)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and panels"):
        _linear(x, _bf16(20, 64, seed=5))
    with pytest.raises(RuntimeError, match="bf16 tensors"):
        cpu_linear.bf16_linear(x.float(), cpu_linear.pack(w), 20)


@needs_kernel
def test_avx512_layers_replace_bias_free_linears_and_keep_onednn_for_a_bias():
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 32, bias=True)).to(torch.bfloat16)
    x = _bf16(5, 64, seed=6)
    reference = model(x)
    assert linear.prepack_linears(model, "bf16-avx512") == 2
    assert isinstance(model[0], linear.AVX512LinearBF16)
    assert isinstance(model[1], linear.PackedLinearBF16)
    y = model(x)
    assert y.shape == reference.shape and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference, atol=0.02, rtol=0.02)
    lm_head = linear.AVX512LinearBF16(nn.Linear(64, 10, bias=False).to(torch.bfloat16), out_dtype=torch.float32)
    assert lm_head(x).dtype == torch.float32


def test_auto_picks_the_avx512_kernel_only_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available", lambda: True)
    monkeypatch.setattr(cpu_linear, "native_bf16_dot", lambda: False)
    assert linear.resolve_weight_format("auto", torch.bfloat16, "cpu") == "bf16-avx512"
    assert linear.resolve_weight_format("auto", torch.float32, "cpu") == "none"
    monkeypatch.setattr(cpu_linear, "native_bf16_dot", lambda: True)
    monkeypatch.setattr(linear, "native_bf16_cpu", lambda: True)
    assert linear.resolve_weight_format("auto", torch.bfloat16, "cpu") == "bf16"
    monkeypatch.setattr(cpu_linear, "native_bf16_dot", lambda: False)
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    assert linear.resolve_weight_format("auto", torch.bfloat16, "cpu") == "bf16"


def test_the_kernel_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    monkeypatch.setattr(cpu_linear, "unavailable_reason", lambda: "the CPU has no AVX-512 (avx512f/bw/dq)")
    with pytest.raises(ValueError, match="no AVX-512.*use --weights bf16 or auto"):
        linear.prepack_linears(nn.Sequential(nn.Linear(8, 8, bias=False)), "bf16-avx512")


def test_every_entry_point_accepts_the_same_weight_formats():
    import typing

    from services.common.env import Settings
    from services.target import config
    assert typing.get_args(Settings.model_fields["weights"].annotation) == linear.WEIGHT_FORMATS
    assert config._WEIGHTS == linear.WEIGHT_FORMATS
