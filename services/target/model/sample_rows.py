"""One token per decoding sequence from its logit row: logits processing, sampling and,
for requests that ask, log-probabilities, in one call for the engine's plain rows.

Rows of requests without penalties, bias or min_tokens are sampled from as they are, and
no probabilities are built for greedy rows unless log-probabilities are asked for.
"""

from __future__ import annotations

import torch

from services.common.sampling_params import SamplingConfig
from services.target.model.logits_processors import LogitsProcessor, process_rows
from services.target.model.logprobs import TokenLogprob, token_logprobs
from services.target.model.sampler import SamplingError, sample


def sample_rows(logits: torch.Tensor, configs: list[SamplingConfig], generators: list[torch.Generator],
                processors: list[LogitsProcessor | None], histories: list[list[int]],
                ) -> tuple[list[int | SamplingError], list[TokenLogprob | None]]:
    """logits: [num_seqs, vocab] raw rows -> (token or SamplingError, its log-probability or
    None) per sequence. `histories[i]`: sequence i's committed tokens (penalties read them)."""
    processed = process_rows(logits, processors, histories)  # [num_seqs, vocab]
    wants = [c.logprobs for c in configs]
    probs: dict[int, torch.Tensor] | None = {} if any(wants) else None
    tokens = sample(processed, configs, generators, probs)
    logprobs: list[TokenLogprob | None] = [None] * len(tokens)
    for i, (token, want) in enumerate(zip(tokens, wants)):
        if want and not isinstance(token, Exception):
            row_probs = probs.get(i) if probs is not None else None
            logprobs[i] = token_logprobs(logits[i:i + 1], processed[i:i + 1], [token], configs[i],
                                         None if row_probs is None else row_probs[None])[0]
    return tokens, logprobs
