"""The greedy rows' argmax in C++ (services/target/kernels/cpu_argmax_rows.cpp, cpu_rowops.argmax_rows):
torch.argmax's answer, the first index of the largest value, on every clean row (no NaN, a finite
largest value), whatever the row length (a multiple of the 64-wide step or not) and wherever the
ties and the largest fall; rows that are not clean are flagged, and the sampler then keeps its
own handling for them."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingConfig
from services.target.kernels import cpu_rowops
from services.target.model import sampler


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 1000, 262_144])
def test_each_rows_first_largest_as_torch_argmax(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(7, n, generator=gen)
    if n > 2:
        x[1] = x[1].round()  # many ties for the largest: the first must win
        x[2, :] = 0.0
        x[2, n - 1] = 0.5  # the largest in the very last entry (the tail)
        x[3, : n // 2] = float("-inf")  # a masked half
    x[4] = -1e30  # every entry equal
    index, ok = cpu_rowops.argmax_rows(x)
    assert torch.equal(index, x.argmax(dim=-1)) and bool(ok.all())


def test_a_row_with_nan_or_no_finite_largest_is_flagged_not_trusted():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    x[0, 17] = float("nan")
    x[1, 200] = float("inf")
    x[2] = float("-inf")
    index, ok = cpu_rowops.argmax_rows(x)
    assert ok.tolist() == [False, False, False, True]
    assert index[3].item() == x[3].argmax().item() and index[2].item() == 0


def test_the_sampler_takes_it_for_float32_greedy_rows(monkeypatch):
    """sample() on a float32 batch reads the C++ pass (torch.argmax is not called) and gives the same
    tokens; a row with a NaN sends the batch to torch's path, which never picks the NaN."""
    logits = torch.randn(18, 5_000, generator=torch.Generator().manual_seed(5)) * 4
    expected = logits.argmax(dim=-1).tolist()
    configs, gens = [SamplingConfig(4)] * 18, [sampler.make_generator(0, "cpu") for _ in range(18)]
    calls = []
    real = torch.Tensor.argmax
    monkeypatch.setattr(torch.Tensor, "argmax", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    assert sampler.sample(logits, configs, gens) == expected and not calls
    logits[7, 9] = float("nan")
    out = sampler.sample(logits, configs, gens)
    assert calls and out[7] != 9 and out[:7] == expected[:7] and out[8:] == expected[8:]


def test_row_argmax_is_torch_argmax_on_any_rows():
    """What the speculator's greedy walk reads: torch.argmax(dim=-1) bit for bit, through the C++
    pass on clean float32 rows and torch's own otherwise (a NaN row, bf16, a non-contiguous view)."""
    x = torch.randn(6, 777, generator=torch.Generator().manual_seed(9)) * 3
    x[1] = x[1].round()
    for rows in (x, x.to(torch.bfloat16), x[:, ::2], torch.where(torch.arange(777) == 5, float("nan"), x)):
        assert torch.equal(sampler.row_argmax(rows), rows.argmax(dim=-1))
