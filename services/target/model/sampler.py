"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Numerically safe for every valid SamplingConfig: logits are shifted so that the
largest is 0 before the temperature divides them (a subnormal temperature then
gives an almost one-hot distribution, never inf/inf = NaN), +inf logits count as
the largest finite value, NaN logits are never chosen, and the nucleus always keeps
the most likely token (a tiny top_p rounding to 0 in float32 keeps one token).
A row with no usable logit at all (every entry NaN or -inf) is a `SamplingError`
for that sequence only: `sample` returns it in that sequence's place.
"""

from __future__ import annotations

import torch

from services.common.sampling_params import SamplingConfig
from services.target.kernels import cpu_kernels, cpu_rowops


class SamplingError(RuntimeError):
    """One sequence's logits admit no token (e.g. all NaN); fails that request only."""


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A request's generator, on the device of the probabilities it will sample (the model's):
    torch draws from a generator only on its own device."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def target_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """logits: [n, vocab] -> probabilities [n, vocab] float32 after temperature, top-k, top-p.

    Raises SamplingError when a row has no usable logit.
    """
    logits = _finite_shifted(logits)  # [n, vocab], max 0 per row, -inf where unusable
    # A temperature below float32's smallest normal would round to 0 (0 / 0 = NaN at the max).
    logits = logits / max(config.temperature, torch.finfo(torch.float32).tiny)
    if 0 < config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if 0.0 < config.top_p < 1.0:
        probs = torch.cat([_nucleus(row, config.top_p) for row in probs.split(1)])
    return probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs: [1, vocab] -> [1, vocab]: the smallest most-likely set whose mass reaches top_p
    (the token crossing it stays), renormalised.

    Sorting a 262k vocabulary costs ~25 ms on two cores; the nucleus is almost always within
    the few hundred most likely tokens. So the `width` largest are taken in order (topk is
    ~30x cheaper than a sort) and widened only while their mass stays below top_p: once it
    reaches top_p every token outside them is dropped, exactly as the full sort would drop it
    (the same prefix, summed in the same order).
    """
    vocab = probs.shape[-1]
    width = min(_NUCLEUS_WIDTH, vocab)
    while True:
        top, order = torch.topk(probs, width, dim=-1)  # [1, width] most likely first
        if width == vocab or float(top.sum()) >= top_p:
            break
        width = min(width * 8, vocab)
    drop = top.cumsum(dim=-1) - top >= top_p  # mass before a token already reached top_p
    drop[..., 0] = False  # the most likely token always stays
    top = top.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, top)
    return out / out.sum(dim=-1, keepdim=True)


_NUCLEUS_WIDTH = 1024  # first guess of the nucleus' size (see _nucleus)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """probs: [vocab] (non-negative, any positive sum) -> one index drawn in proportion to it.

    Inverse CDF over a float64 running sum with one uniform from `generator`: the same law as
    torch.multinomial, ~20x cheaper on a 262k vocabulary (multinomial costs ~5 ms there).
    Only an entry with positive probability can be drawn.
    """
    cdf = probs.double().cumsum(dim=0)  # [vocab]
    u = torch.rand(1, generator=generator, device=probs.device, dtype=torch.float64)  # [1]
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True).item())
    if index >= cdf.shape[0]:  # u * total rounded up to the total: the last positive entry
        index = int(torch.nonzero(probs > 0)[-1].item())
    return index


def sample(logits: torch.Tensor, configs: list[SamplingConfig],
           generators: list[torch.Generator],
           probs_out: dict[int, torch.Tensor] | None = None) -> list[int | SamplingError]:
    """logits: [num_seqs, vocab] -> one token id per sequence, or its SamplingError.

    A failure of one sequence never affects the others' tokens. `probs_out`, when given,
    receives row i's sampling probabilities ([vocab]) for every sampled (non-greedy) row,
    so log-probabilities need not compute them again.
    """
    greedy, usable = _argmax_rows(logits)
    out: list[int | SamplingError] = []
    for i, (config, gen) in enumerate(zip(configs, generators)):
        if not usable[i]:
            out.append(SamplingError("the model produced no finite logit for this sequence"))
        elif config.greedy:
            out.append(greedy[i])
        else:
            try:
                probs = target_probs(logits[i:i + 1], config)[0]
                if probs_out is not None:
                    probs_out[i] = probs
                out.append(draw(probs, gen))
            except (SamplingError, RuntimeError) as exc:  # never fail the batch for one row
                out.append(exc if isinstance(exc, SamplingError) else SamplingError(str(exc)))
    return out


def _argmax_rows(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """logits: [num_seqs, vocab] -> (argmax per row, whether the row has a usable logit).

    One pass in the usual case: torch's argmax takes a NaN or +inf where a row has one, so
    when every row's argmax value is finite the rows have neither, and the raw argmax is the
    answer. Only otherwise are the rows converted and cleaned (NaN never chosen, +inf the
    largest): passes over the batch's logits that cost milliseconds at 18 rows of a 262k
    vocabulary.
    """
    index = row_argmax(logits)  # [num_seqs]
    if bool(torch.isfinite(logits.gather(-1, index[:, None])).all()):
        return index.tolist(), [True] * logits.shape[0]
    safe = _finite_shifted(logits, check=False)  # [num_seqs, vocab]
    # The max is 0 unless no logit of the row is usable.
    return safe.argmax(dim=-1).tolist(), (safe.amax(dim=-1) == 0).tolist()


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [M, N] -> torch.argmax(logits, dim=-1) [M] int64: through specmesh's C++ pass (one
    vectorized read, ~10x torch's at 18 rows of a 262k vocabulary) where the logits are float32 on
    the CPU and every row is clean (no NaN, a finite largest value), else torch's own."""
    if (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
            and logits.shape[1] > 0 and logits.is_contiguous() and cpu_kernels.available()):
        index, ok = cpu_rowops.argmax_rows(logits)
        if bool(ok.all()):
            return index
    return logits.argmax(dim=-1)


def _finite_shifted(logits: torch.Tensor, check: bool = True) -> torch.Tensor:
    """logits: [n, vocab] -> float32 [n, vocab] with each row's max at 0.

    NaN becomes -inf (never sampled); +inf becomes the float32 maximum, so an
    overflowing logit is simply the most likely token. A row with no usable logit
    stays all -inf (or NaN after the shift) and raises when `check`.
    """
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max,
                         neginf=float("-inf"))  # (its default would make -inf the lowest finite value)
    top = x.amax(dim=-1, keepdim=True)  # [n, 1]
    if check and not bool(torch.isfinite(top).all()):
        raise SamplingError("the model produced no finite logit for this sequence")
    return x - top
