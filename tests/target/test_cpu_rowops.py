"""The lean forwards' per-row ops in C++ (services/target/kernels/cpu_rowops.cpp) against their
own torch ops (services/target/model/gemma3_forward.py, llama_forward.py)."""

from __future__ import annotations

import pytest
import torch

from services.target.model.gemma3_forward import _rms_norm, _rotate_half
from services.target.model.llama_forward import _rms_norm as _llama_rms_norm
from services.target.kernels import cpu_linear, cpu_rowops

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason=f"{cpu_linear.unavailable_reason()}")
EPS = 1e-6


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _weight(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 1.0 + torch.randn(*shape, generator=g) * 0.3  # f32, 1 + weight


def _within_one_step(ours: torch.Tensor, theirs: torch.Tensor, at_most: float = 0.01) -> None:
    """Equal, but for outputs one bf16 rounding step apart (another order of the sum of squares)."""
    a, b = ours.float(), theirs.float()
    step = torch.maximum(a.abs(), b.abs()) * 2.0**-7 + 1e-30
    assert bool(((a - b).abs() <= step).all())
    assert (a != b).float().mean().item() <= at_most


@pytest.mark.parametrize("rows,dim", [(1, 640), (7, 640), (300, 640), (3, 40), (5, 1)])
def test_rms_norm_matches_torch_within_a_rounding_step(rows, dim):
    x, w = _bf16(rows, dim, seed=rows, scale=3.0), _weight(dim, seed=dim)
    _within_one_step(cpu_rowops.rms_norm(x, w, EPS), _rms_norm(x, w, EPS))


def test_rms_norm_takes_one_weight_row_per_head_and_strided_rows():
    x = _bf16(6, 10, 256, seed=1)  # [T, heads, D]
    w = _weight(10, 256, seed=2)  # per head
    ours = cpu_rowops.rms_norm(x.view(-1, 256), w, EPS).view(6, 10, 256)
    _within_one_step(ours, _rms_norm(x, w, EPS))
    wide = _bf16(4, 1280, seed=3)
    w_wide = _weight(640, seed=4)
    _within_one_step(cpu_rowops.rms_norm(wide[:, :640], w_wide, EPS), _rms_norm(wide[:, :640], w_wide, EPS))


def test_add_rms_norm_is_the_residual_add_then_the_next_norm():
    h, a = _bf16(9, 640, seed=5, scale=4.0), _bf16(9, 640, seed=6)
    w_a, w_next = _weight(640, seed=7), _weight(640, seed=8)
    h_new, x = cpu_rowops.add_rms_norm(h, a, w_a, w_next, EPS)
    # Given the same normed a, the add is torch's bit for bit; the next norm reads our h_new.
    torch_h = h + _rms_norm(a, w_a, EPS)
    _within_one_step(h_new, torch_h)
    assert torch.equal(h_new, h + cpu_rowops.rms_norm(a, w_a, EPS))
    _within_one_step(x, _rms_norm(h_new, w_next, EPS))


@pytest.mark.parametrize("heads,kv,d", [(4, 1, 256), (4, 2, 16), (2, 1, 40)])  # the default model's, tiny, odd halves
def test_qk_norm_rope_equals_the_lean_forwards_torch_ops(heads, kv, d):
    t = 5
    qkv = _bf16(t, (heads + 2 * kv) * d, seed=9)
    w = _weight(heads + kv, d, seed=10)
    positions = torch.arange(t) * 37.0
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)  # [T, D]
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    q, k, v = cpu_rowops.qk_norm_rope(qkv, w, cos, sin, heads, kv, EPS)
    qk = qkv[:, :(heads + kv) * d].view(t, heads + kv, d)
    # The rotation after our norm is torch's, bit for bit; the norm within a rounding step.
    normed = cpu_rowops.rms_norm(qk.reshape(-1, d), w, EPS).view(t, heads + kv, d)
    _within_one_step(normed, _rms_norm(qk, w, EPS))
    rotated = normed * cos[:, None] + _rotate_half(normed) * sin[:, None]
    assert torch.equal(q, rotated[:, :heads]) and torch.equal(k, rotated[:, heads:])
    assert torch.equal(v, qkv[:, (heads + kv) * d:].view(t, kv, d))
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize("rows,dim", [(1, 896), (7, 896), (300, 64), (3, 40)])
def test_llama_family_norm_rounds_before_its_bf16_weight(rows, dim):
    """weight_after: LlamaRMSNorm's weight * bf16(normed), the weight in bf16 (passed as float32);
    within a rounding step of torch, and not Gemma's rounding (they differ on some outputs)."""
    x = _bf16(rows, dim, seed=rows, scale=3.0)
    w = _weight(dim, seed=dim).to(torch.bfloat16)  # [D] the model's dtype
    ours = cpu_rowops.rms_norm(x, w.float(), EPS, weight_after=True)
    _within_one_step(ours, _llama_rms_norm(x, w, EPS))
    if rows * dim > 1000:
        assert not torch.equal(ours, cpu_rowops.rms_norm(x, w.float(), EPS))


def test_plain_residual_add_then_the_llama_norm():
    h, a = _bf16(9, 896, seed=15, scale=4.0), _bf16(9, 896, seed=16)
    w_next = _weight(896, seed=17).to(torch.bfloat16)
    h_new, x = cpu_rowops.add_rms_norm(h, a, None, w_next.float(), EPS, weight_after=True)
    assert torch.equal(h_new, h + a)  # torch's bf16 add, bit for bit
    _within_one_step(x, _llama_rms_norm(h_new, w_next, EPS))


@pytest.mark.parametrize("heads,kv,d,qk_norm", [(14, 2, 64, False), (16, 8, 128, True), (4, 2, 16, False)])
def test_rope_with_and_without_the_qwen3_qk_norm(heads, kv, d, qk_norm):
    """Qwen2.5-0.5B's and Qwen3-0.6B's head shapes: no norm (RoPE of the raw heads, torch's bit for
    bit) or Qwen3's per-head norm in the Llama rounding (within a rounding step)."""
    t = 5
    qkv = _bf16(t, (heads + 2 * kv) * d, seed=18)
    w = _weight(heads + kv, d, seed=19).to(torch.bfloat16) if qk_norm else None
    positions = torch.arange(t) * 29.0
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)  # [T, D]
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    q, k, v = cpu_rowops.qk_norm_rope(qkv, None if w is None else w.float(), cos, sin, heads, kv, EPS,
                                      weight_after=True)
    qk = qkv[:, :(heads + kv) * d].view(t, heads + kv, d)
    if qk_norm:
        normed = cpu_rowops.rms_norm(qk.reshape(-1, d), w.float(), EPS, weight_after=True).view(t, heads + kv, d)
        _within_one_step(normed, _llama_rms_norm(qk, w, EPS))
    else:
        normed = qk
    rotated = normed * cos[:, None] + _rotate_half(normed) * sin[:, None]
    assert torch.equal(q, rotated[:, :heads]) and torch.equal(k, rotated[:, heads:])
    assert torch.equal(v, qkv[:, (heads + kv) * d:].view(t, kv, d))


def test_silu_mul_matches_torch_within_a_rounding_step():
    gate_up = _bf16(7, 2 * 1000, seed=20, scale=3.0)
    gate, up = gate_up[:, :1000], gate_up[:, 1000:]
    ours = cpu_rowops.silu_mul(gate_up)
    assert ours.shape == (7, 1000) and ours.dtype == torch.bfloat16
    _within_one_step(ours, torch.nn.functional.silu(gate) * up, at_most=0.02)
    huge = torch.tensor([[-100.0, 100.0, 0.0, 1.0, 1.0, 1.0]], dtype=torch.bfloat16)  # gates, then ups
    got = cpu_rowops.silu_mul(huge)  # exp's input is clamped to 88: silu(-100) ~ -6e-37, torch's ~ -4e-42
    assert got[0, 1:].tolist() == [100.0, 0.0] and abs(got[0, 0].item()) < 1e-30


def test_bad_shapes_and_dtypes_are_refused():
    x = _bf16(2, 64, seed=11)
    with pytest.raises(RuntimeError, match="float32 contiguous weight"):
        cpu_rowops.rms_norm(x, _weight(32, seed=1), EPS)
    with pytest.raises(RuntimeError, match="bf16 \\[rows, D\\]"):
        cpu_rowops.rms_norm(x.float(), _weight(64, seed=1), EPS)
    with pytest.raises(RuntimeError, match="qkv \\[T, \\(H \\+ 2 KV\\) \\* D\\]"):
        cpu_rowops.qk_norm_rope(_bf16(2, 100, seed=1), _weight(2, 64, seed=1), x, x, 1, 1, EPS)
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_rowops.qk_norm_rope(_bf16(2, 192, seed=1), _weight(2, 64, seed=1), x[:, :32], x, 1, 1, EPS)


def test_gelu_tanh_mul_matches_torch():
    gate_up = _bf16(7, 2 * 1000, seed=12, scale=2.0)  # 1000: a part vector at the end
    gate, up = gate_up[:, :1000], gate_up[:, 1000:]
    theirs = torch.nn.functional.gelu(gate, approximate="tanh") * up
    ours = cpu_rowops.gelu_tanh_mul(gate_up)
    assert ours.shape == (7, 1000) and ours.dtype == torch.bfloat16
    # Equal for gates above -3 (0 of ~250k differed on 2026-11-30); below, 1 + tanh cancels in
    # torch's formula and ours, and both keep only ~1e-7 of it: tiny values within 1e-4.
    plain = gate.float() > -3
    assert torch.equal(ours[plain], theirs[plain])
    assert bool(((ours.float() - theirs.float()).abs()[~plain] < 1e-4).all())
    huge = torch.tensor([[-100.0, 100.0, 0.0, 1.0, 1.0, 1.0]], dtype=torch.bfloat16)  # gates, then ups
    assert cpu_rowops.gelu_tanh_mul(huge).tolist() == [[-0.0, 100.0, 0.0]]


def test_masked_softmax_matches_torch_within_a_rounding_step_and_zeroes_rows_that_see_nothing():
    scores = _bf16(8, 5, 300, seed=13, scale=4.0)  # [heads, rows, entries]
    g = torch.Generator().manual_seed(14)
    hidden = torch.rand(5, 300, generator=g) < 0.3
    hidden[2] = True  # a row that sees nothing
    theirs = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    ours = cpu_rowops.masked_softmax_(scores.clone(), hidden)
    seen = torch.tensor([r != 2 for r in range(5)])
    _within_one_step(ours[:, seen], theirs[:, seen], at_most=0.02)
    assert bool((ours[:, hidden] == 0).all()) and bool((ours[:, 2] == 0).all())
    plain = _bf16(3, 2, 17, seed=15)  # no mask; a part vector
    _within_one_step(cpu_rowops.masked_softmax_(plain.clone(), None), torch.softmax(plain, -1), at_most=0.05)
