"""Log-probabilities of committed tokens, and the most likely alternatives per position.

Under the distribution actually sampled from: the processed logits (bias, min_tokens,
penalties; services/target/model/logits_processors.py), then temperature, top-k and top-p
(services/target/model/sampler.target_probs); tokens those filters drop have -inf. A greedy
request samples from argmax, so its log-probabilities are those of the processed logits at
temperature 1 without top-k/top-p. `raw_logprobs` asks for the raw model distribution
(log-softmax of the target's logits) instead. Under speculation the rows are the target's
own verify rows along the accepted path, never the draft's: an accepted draft token gets
exactly the value it would have had if decoded without speculation.

Only requests that ask for log-probabilities reach this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.sampling_params import SamplingConfig
from services.target.model.sampler import target_probs


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its log-probability and the top alternatives, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)


def token_logprobs(raw: torch.Tensor, processed: torch.Tensor, tokens: list[int],
                   config: SamplingConfig, probs: torch.Tensor | None = None) -> list[TokenLogprob]:
    """raw, processed: [m, vocab] the rows that chose `tokens` ([m]); `probs` ([m, vocab]) the
    sampling probabilities when the caller has them already (sampled requests)."""
    # Only the chosen and top-k entries are turned into log-probabilities: the ranking of
    # logits (and of probabilities) is that of their log-probabilities.
    if config.raw_logprobs or config.greedy:
        base = (raw if config.raw_logprobs else processed).float()  # [m, vocab] logits
        shift = torch.logsumexp(base, dim=-1, keepdim=True)  # [m, 1]
        to_logprob = lambda values: values - shift  # noqa: E731
    else:
        base = probs if probs is not None else target_probs(processed, config)  # [m, vocab]
        to_logprob = torch.log
    index = torch.tensor(tokens, dtype=torch.int64, device=base.device)[:, None]  # [m, 1]
    chosen = to_logprob(base.gather(-1, index))[:, 0].tolist()  # [m]
    if not config.top_logprobs:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    top = torch.topk(base, min(config.top_logprobs, base.shape[-1]), dim=-1)  # sorted, most likely first
    values = to_logprob(top.values).tolist()  # [m, k]
    return [TokenLogprob(t, c, tuple(zip(ids, v)))
            for t, c, ids, v in zip(tokens, chosen, top.indices.tolist(), values)]
