"""The sampler's two shortcuts keep the law they replace: the nucleus taken from the most
likely tokens (instead of a full sort of the vocabulary) and the inverse-CDF draw (instead of
torch.multinomial)."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.sampling_params import SamplingConfig
from services.target.model import sampler
from services.target.model.sampler import SamplingError, draw, make_generator, sample, target_probs


def full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: sort the whole row. probs: [1, vocab] -> [1, vocab]."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    drop[..., 0] = False
    out = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return out / out.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("scale", [0.5, 4.0, 20.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_nucleus_equals_the_full_sort(scale: float, top_p: float) -> None:
    logits = torch.randn(3, 20_000, generator=torch.Generator().manual_seed(7)) * scale  # [3, vocab]
    config = SamplingConfig(max_tokens=1, temperature=1.0, top_p=top_p)
    expected = torch.cat([full_sort_nucleus(row, top_p) for row in torch.softmax(logits, -1).split(1)])
    torch.testing.assert_close(target_probs(logits, config), expected, rtol=1e-6, atol=1e-9)


def test_a_nucleus_wider_than_the_first_guess_is_widened(monkeypatch) -> None:
    # 5,000 nearly equally likely tokens (distinct, so no tie decides): top_p 0.99 keeps
    # thousands of them, far past the first width of 16.
    monkeypatch.setattr(sampler, "_NUCLEUS_WIDTH", 16)
    logits = torch.full((1, 8_000), -30.0)
    logits[0, :5_000] = -torch.arange(5_000) * 1e-5
    probs = target_probs(logits, SamplingConfig(max_tokens=1, temperature=1.0, top_p=0.99))
    assert 4_900 < int((probs > 0).sum()) < 5_000
    torch.testing.assert_close(probs, full_sort_nucleus(torch.softmax(logits, -1), 0.99))


def test_draw_follows_the_probabilities() -> None:
    probs = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0])  # zeros inside and at the end
    gen = make_generator(3, "cpu")
    n = 40_000
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(n)]), minlength=7)
    assert counts[probs == 0].sum() == 0  # a zero-probability token is never drawn
    support = probs > 0
    expected = probs[support] * n
    chi2 = float((((counts[support] - expected) ** 2) / expected).sum())
    assert chi2 < 16.27, chi2  # df 3, p = 0.001


def test_draw_takes_the_last_positive_token_when_the_uniform_rounds_to_the_total(monkeypatch) -> None:
    probs = torch.tensor([0.3, 0.7, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert draw(probs, make_generator(0, "cpu")) == 1


def test_unnormalised_weights_are_drawn_in_proportion() -> None:
    probs = torch.tensor([2.0, 6.0])  # any positive sum
    gen = make_generator(5, "cpu")
    share = sum(draw(probs, gen) for _ in range(20_000)) / 20_000
    assert math.isclose(share, 0.75, abs_tol=0.015)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_rows_read_the_raw_argmax_and_fall_back_on_nan_or_inf(dtype) -> None:
    logits = (torch.randn(4, 3_000, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)  # [4, vocab]
    logits[1, :2_000] = float("-inf")  # a grammar-masked row: still a finite maximum
    greedy = [SamplingConfig(4) for _ in range(4)]
    gens = [make_generator(0, "cpu") for _ in range(4)]
    expected = logits.float().argmax(dim=-1).tolist()
    assert sample(logits, greedy, gens) == expected
    # A NaN in one row: that row never picks it, the others keep their argmax.
    poisoned = logits.clone()
    poisoned[2, 5] = float("nan")
    out = sample(poisoned, greedy, gens)
    assert out[:2] == expected[:2] and out[3] == expected[3]
    assert out[2] == poisoned[2].float().nan_to_num(nan=float("-inf")).argmax().item() != 5
    # A row with no usable logit fails alone.
    poisoned[3] = float("-inf")
    assert isinstance(sample(poisoned, greedy, gens)[3], SamplingError)


def test_a_row_without_a_usable_logit_fails_greedy_and_sampled() -> None:
    # Every entry -inf (e.g. a mask that leaves nothing): torch.nan_to_num's default turns
    # -inf into the lowest finite float, which once made such a row sample token 0 (greedy)
    # or a uniform draw over the vocabulary (sampled).
    logits = torch.zeros(2, 6)
    logits[1] = float("-inf")
    for config in (SamplingConfig(4), SamplingConfig(4, temperature=0.7, seed=1)):
        out = sample(logits, [config, config], [make_generator(0, "cpu"), make_generator(0, "cpu")])
        assert not isinstance(out[0], Exception) and isinstance(out[1], SamplingError)
    with pytest.raises(SamplingError):
        target_probs(logits[1:], SamplingConfig(4, temperature=0.7))
