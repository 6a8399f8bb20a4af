"""The AVX-512 bf16 linear kernel (services/target/kernels/cpu_linear.cpp) against exact references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.target.model import linear
from services.target.kernels import cpu_linear

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason=f"{cpu_linear.unavailable_reason()}")
# The inner loops this CPU runs: widen + FMA everywhere the kernel builds, VDPBF16PS where the CPU has it.
INNER_LOOPS = [False] + ([True] if cpu_linear.bf16_dot_instruction() else [])


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _linear(x: torch.Tensor, w: torch.Tensor, dot: bool | None = None) -> torch.Tensor:
    return cpu_linear.bf16_linear(x, cpu_linear.pack(w), w.shape[0], dot=dot)


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


def _pairwise_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """VDPBF16PS's arithmetic as Intel documents it: per pair of k (K padded to even with a zero),
    add the odd k's product, then the even k's, each add rounded to float32; then bf16."""
    xf, wf = x.float(), w.float()
    if x.shape[1] % 2:
        xf, wf = torch.nn.functional.pad(xf, (0, 1)), torch.nn.functional.pad(wf, (0, 1))
    acc = torch.zeros(x.shape[0], w.shape[0])  # [M, N] f32
    for k in range(0, xf.shape[1], 2):
        acc += xf[:, k + 1:k + 2] * wf[:, k + 1]
        acc += xf[:, k:k + 1] * wf[:, k]
    return acc.to(torch.bfloat16)


LOOPS_AND_REFERENCES = [  # each loop against its arithmetic written out in torch
    pytest.param(False, _sequential_reference, id="fma-k-in-order"),
    pytest.param(True, _pairwise_reference, id="vdpbf16ps-pairs", marks=pytest.mark.skipif(
        not cpu_linear.bf16_dot_instruction(), reason="the CPU has no AVX512-BF16"))]


@needs_kernel
@pytest.mark.parametrize("dot,reference", LOOPS_AND_REFERENCES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 25, 97])  # every microtile, past the 96-row pass
@pytest.mark.parametrize("n,k", [(37, 200), (128, 33), (5, 1), (640, 24)])  # a part panel, whole panels, odd K, one column, 20 panels
def test_each_loop_equals_its_float32_sums_bit_for_bit(rows, n, k, dot, reference):
    x, w = _bf16(rows, k, seed=rows), _bf16(n, k, seed=n + k, scale=0.05)
    y = _linear(x, w, dot=dot)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert torch.equal(y, reference(x, w))


@needs_kernel
def test_a_few_row_call_splits_its_panels_evenly_over_the_threads():
    """1-3 rows stream the weights: the thread with the most panels sets the call's time. 20 panels
    (640 outputs) in groups of 8 would leave one of 2 threads 16; groups of 2 give each 10."""
    groups = cpu_linear._module().few_row_panel_groups
    assert groups(20, 8, 2) == 2 and groups(20, 4, 2) == 2
    assert groups(48, 8, 2) == 8 and groups(8192, 8, 2) == 8  # 6 and 1,024 groups of 8 split evenly already
    assert groups(128, 4, 2) == 4 and groups(1, 8, 2) == 8 and groups(20, 8, 1) == 8  # one thread: the widest


@needs_kernel
@pytest.mark.skipif(not cpu_linear.bf16_dot_instruction(), reason="the CPU has no AVX512-BF16")
def test_the_two_loops_add_in_the_orders_they_state():
    # Sums where float32 rounding shows the order: 2^24 + 1 rounds back to 2^24.
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    cancel_odd = torch.tensor([[2.0**24, 0, 1, -2.0**24]], dtype=torch.bfloat16)
    cancel_even = torch.tensor([[2.0**24, 0, -2.0**24, 1]], dtype=torch.bfloat16)
    assert _linear(x, cancel_odd, dot=False).item() == 0  # ((2^24 + 1) - 2^24): k in order
    assert _linear(x, cancel_odd, dot=True).item() == 1  # ((2^24 - 2^24) + 1): odd k first
    assert _linear(x, cancel_even, dot=False).item() == 1
    assert _linear(x, cancel_even, dot=True).item() == 0


@needs_kernel
@pytest.mark.parametrize("dot", INNER_LOOPS)
def test_the_kernel_rounds_to_bf16_as_torch_does_ties_overflow_and_nan(dot):
    x = torch.tensor([[1.0, 1.0], [float("nan"), 1.0]], dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 2.0**-8],  # 1 + 2^-8: a tie, to even (1.0)
                      [1.0, 3 * 2.0**-8],  # a tie, to even (1 + 2^-6)
                      [1.0, -(2.0**-8)],  # 1 - 2^-8: exact in bf16
                      [3.0e38, 3.0e38],  # past float32's range: inf
                      [torch.finfo(torch.bfloat16).max, 2.0**119]],  # half a step past bf16's largest: inf
                     dtype=torch.bfloat16)
    y = _linear(x, w, dot=dot)
    expected = _sequential_reference(x[:1], w)
    assert torch.equal(y[:1], expected)
    assert expected[0].tolist() == [1.0, 1.0 + 2.0**-6, 1.0 - 2.0**-8, float("inf"), float("inf")]
    assert bool(y[1].isnan().all())


def test_asking_for_the_dot_loop_without_avx512_bf16_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_linear, "bf16_dot_instruction", lambda: False)
    with pytest.raises(ValueError, match="AVX512-BF16"):
        cpu_linear.bf16_linear(torch.ones(1, 2, dtype=torch.bfloat16), torch.zeros(1, 1, 64, dtype=torch.bfloat16),
                               1, dot=True)


@needs_kernel
@pytest.mark.parametrize("dot", INNER_LOOPS)
def test_a_rows_outputs_do_not_depend_on_the_other_rows_of_the_call(dot):
    x, w = _bf16(200, 640, seed=7), _bf16(300, 640, seed=8, scale=0.05)
    panels = cpu_linear.pack(w)
    alone = torch.cat([cpu_linear.bf16_linear(x[i:i + 1], panels, 300, dot=dot) for i in range(200)])
    for rows in (2, 3, 5, 6, 11, 12, 40, 200):  # each microtile shape the kernel picks, past 96 rows
        assert torch.equal(cpu_linear.bf16_linear(x[:rows], panels, 300, dot=dot), alone[:rows])


@needs_kernel
@pytest.mark.parametrize("dot", INNER_LOOPS)
@pytest.mark.parametrize("rows", [1, 11, 512])
def test_kernel_differs_from_torch_bf16_linear_by_at_most_one_rounding_step(rows, dot):
    # Same products, same float32 accumulation, another summation order: an output may land on
    # the other side of a bf16 rounding boundary, never further.
    x, w = _bf16(rows, 1024, seed=1), _bf16(640, 1024, seed=2, scale=0.05)
    ours, theirs = _linear(x, w, dot=dot).float(), torch.nn.functional.linear(x, w).float()
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
def test_avx512_layers_replace_every_linear_and_add_a_bias_within_two_rounding_steps():
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 32, bias=True)).to(torch.bfloat16)
    x = _bf16(5, 64, seed=6)
    reference = model(x)
    assert linear.prepack_linears(model, "bf16-avx512") == 2
    assert isinstance(model[0], linear.AVX512LinearBF16)
    assert isinstance(model[1], linear.AVX512LinearBF16)  # a bias (Qwen2's q/k/v) no longer leaves the kernel
    y = model(x)
    assert y.shape == reference.shape and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference, atol=0.02, rtol=0.02)
    lm_head = linear.AVX512LinearBF16(nn.Linear(64, 10, bias=False).to(torch.bfloat16), out_dtype=torch.float32)
    assert lm_head(x).dtype == torch.float32


@needs_kernel
def test_a_lean_forward_multiplies_through_matmul_rows_with_the_layers_own_results():
    """`direct_rows` hands a lean forward each kernel layer's matmul_rows (no nn.Module call): the
    same outputs as the module's forward, with and without a bias, and for a float32 lm_head."""
    x = _bf16(3, 64, seed=9)
    for layer in (linear.AVX512LinearBF16(nn.Linear(64, 40, bias=False).to(torch.bfloat16)),
                  linear.AVX512LinearBF16(nn.Linear(64, 40, bias=True).to(torch.bfloat16)),
                  linear.AVX512LinearBF16(nn.Linear(64, 40, bias=False).to(torch.bfloat16), out_dtype=torch.float32)):
        fast = linear.direct_rows(layer)
        assert fast == layer.matmul_rows
        y = fast(x)
        assert torch.equal(y, layer(x)) and y.dtype == layer(x).dtype
    plain = nn.Linear(64, 40)
    assert linear.direct_rows(plain) is plain  # no kernel: the module itself


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_a_biased_kernel_output_is_within_one_bf16_step_of_torch(rows):
    # The bias is summed with the products in float32 (an input column of ones), then the one
    # rounding, as torch does: one step at most (summation order), in few outputs.
    layer = nn.Linear(256, 160, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.bias.copy_(_bf16(160, seed=8, scale=2.0))  # biases the size of the products
    x = _bf16(rows, 256, seed=7)
    ours = linear.AVX512LinearBF16(layer)(x).float()
    theirs = layer(x).float()
    step = torch.maximum(ours.abs(), theirs.abs()) * 2.0**-7
    summation = 2 * (x.shape[1] + 1) * 2.0**-24 * (x.float().abs() @ layer.weight.float().abs().T + layer.bias.float().abs())
    assert bool(((ours - theirs).abs() <= step + summation).all())
    assert (ours != theirs).float().mean().item() < 0.01


def test_auto_picks_the_avx512_kernel_wherever_it_builds(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available", lambda: True)
    for hardware_dot in (False, True):  # VDPBF16PS where the CPU has it, widen + FMA elsewhere
        monkeypatch.setattr(cpu_linear, "bf16_dot_instruction", lambda: hardware_dot)
        monkeypatch.setattr(linear, "native_bf16_cpu", lambda: hardware_dot)
        assert linear.resolve_weight_format("auto", torch.bfloat16, "cpu") == "bf16-avx512"
        assert linear.resolve_weight_format("auto", torch.float32, "cpu") == "none"
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    assert linear.resolve_weight_format("auto", torch.bfloat16, "cpu") == "bf16"  # oneDNN's
    monkeypatch.setattr(linear, "native_bf16_cpu", lambda: False)
    assert linear.resolve_weight_format("auto", torch.bfloat16, "cpu") == "fp16"


def test_the_kernel_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    monkeypatch.setattr(cpu_linear, "unavailable_reason", lambda: "the CPU has no AVX-512 (avx512f/bw/dq/vl)")
    with pytest.raises(ValueError, match="no AVX-512.*use --weights bf16 or auto"):
        linear.prepack_linears(nn.Sequential(nn.Linear(8, 8, bias=False)), "bf16-avx512")

