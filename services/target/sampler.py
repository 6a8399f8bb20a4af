"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from services.common.sampling_params import SamplingConfig


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def target_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """logits: [n, vocab] -> probabilities [n, vocab] float32 after temperature, top-k, top-p."""
    logits = logits.float() / config.temperature
    if config.top_k > 0 and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if 0.0 < config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p (the token crossing it stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= config.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, configs: list[SamplingConfig],
           generators: list[torch.Generator]) -> list[int]:
    """logits: [num_seqs, vocab] -> one token id per sequence."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, (config, gen) in enumerate(zip(configs, generators)):
        if config.greedy:
            out.append(greedy[i])
            continue
        probs = target_probs(logits[i:i + 1], config)[0]
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
