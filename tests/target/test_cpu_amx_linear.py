"""The AMX tile path of the bf16 linear kernel (services/target/kernels/cpu_amx_linear.cpp).

It reads the panels the VDPBF16PS loop reads. Its sums run over the k pairs in order, but the
hardware adds inside a tile step in its own way, so an output may differ from the VDPBF16PS loop's by
one bf16 rounding step (about 1 in 10,000 on random rows); each row's outputs still never depend on
the other rows of a call.
"""

from __future__ import annotations

import pytest
import torch

from services.target.kernels import cpu_linear

needs_amx = pytest.mark.skipif(not (cpu_linear.available() and cpu_linear.amx()),
                               reason="the CPU has no AMX-BF16, or the OS did not grant its tiles")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _bf16_step(y: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step (unit in the last place) at each value of y [..] bf16."""
    bits = y.view(torch.int16).to(torch.int32) & 0x7FFF
    up = (bits + 1).to(torch.int16).view(torch.bfloat16).float()
    return (up - bits.to(torch.int16).view(torch.bfloat16).float()).abs()


@needs_amx
@pytest.mark.parametrize("m, n, k", [(3, 40, 64), (16, 96, 640), (18, 1536, 640), (33, 100, 2048), (300, 64, 1024)])
def test_amx_is_the_bf16_product_within_one_rounding_step(m: int, n: int, k: int) -> None:
    x, w = _bf16(m, k, seed=m), _bf16(n, k, seed=n + k)
    panels = cpu_linear.pack(w)
    got = cpu_linear.amx_linear(x, panels, n)
    dot = cpu_linear.bf16_linear(x, panels, n, dot=True)
    exact = x.double() @ w.double().T  # [m, n]
    # float32 sums over k products of ~unit size: a few float32 steps at most, then one bf16 rounding.
    assert ((got.double() - exact).abs() <= _bf16_step(got).double() + 1e-4 * k ** 0.5).all()
    differ = (got != dot)
    assert differ.float().mean().item() < 0.002
    # where they differ: by a rounding step of either (near zero, where float32 sums cancel, a few more)
    assert ((got.float() - dot.float()).abs()[differ] <= (_bf16_step(dot) + _bf16_step(got))[differ] + 1e-5).all()


@needs_amx
def test_amx_rows_do_not_depend_on_the_other_rows() -> None:
    x, w = _bf16(37, 256, seed=1), _bf16(70, 256, seed=2)
    panels = cpu_linear.pack(w)
    whole = cpu_linear.amx_linear(x, panels, 70)
    for i in (0, 15, 16, 36):  # first and last of a tile, and the padded last tile
        assert torch.equal(cpu_linear.amx_linear(x[i:i + 1], panels, 70)[0], whole[i])
    assert torch.equal(cpu_linear.amx_linear(x[5:25], panels, 70), whole[5:25])


@needs_amx
def test_bf16_linear_takes_amx_from_three_rows_when_k_allows() -> None:
    w = _bf16(64, 128, seed=3)
    panels = cpu_linear.pack(w)
    for m in (1, 2):
        x = _bf16(m, 128, seed=m)
        assert torch.equal(cpu_linear.bf16_linear(x, panels, 64), cpu_linear.bf16_linear(x, panels, 64, dot=True))
    x = _bf16(cpu_linear.AMX_MIN_ROWS + 5, 128, seed=9)
    assert torch.equal(cpu_linear.bf16_linear(x, panels, 64), cpu_linear.amx_linear(x, panels, 64))
    # K not a multiple of 32 (Qwen2's biased q/k/v has one more input column): the VDPBF16PS loop.
    w_odd = _bf16(64, 129, seed=4)
    x_odd = _bf16(20, 129, seed=5)
    odd_panels = cpu_linear.pack(w_odd)
    assert torch.equal(cpu_linear.bf16_linear(x_odd, odd_panels, 64),
                       cpu_linear.bf16_linear(x_odd, odd_panels, 64, dot=True))
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        cpu_linear.amx_linear(x_odd, odd_panels, 64)


@pytest.mark.skipif(not cpu_linear.available(), reason=f"{cpu_linear.unavailable_reason()}")
def test_switching_amx_off_keeps_the_vdpbf16ps_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECMESH_AMX=0 (or a CPU without AMX): every call takes the loop the CPU has, and asking for
    AMX tiles says why not."""
    monkeypatch.setenv("SPECMESH_AMX", "0")
    cpu_linear.amx_cpu.cache_clear()
    cpu_linear.amx.cache_clear()
    try:
        assert not cpu_linear.amx()
        x, w = _bf16(20, 128, seed=6), _bf16(48, 128, seed=7)
        panels = cpu_linear.pack(w)
        loop = cpu_linear.bf16_linear(x, panels, 48, dot=cpu_linear.bf16_dot_instruction())
        assert torch.equal(cpu_linear.bf16_linear(x, panels, 48), loop)
        with pytest.raises(ValueError, match="AMX"):
            cpu_linear.amx_linear(x, panels, 48)
    finally:  # read again once the environment is restored
        cpu_linear.amx_cpu.cache_clear()
        cpu_linear.amx.cache_clear()
