"""The head's draft vocabulary (EAGLE-3's reduced vocabulary, arXiv 2503.01840 section 3): the
tokens the target most often puts probability on in the training rollouts. The head scores only
these: its output layer is the target's LM head restricted to their rows, so a draft step reads
|draft vocabulary| x hidden weights instead of the whole vocabulary's (262,144 rows for Gemma 3:
the LM head would otherwise cost more than the head's decoder layer many times over).

Drafts never leave the draft vocabulary; that is lossless as long as a sampled node's q is the
distribution it was drawn from (over the draft vocabulary, zero elsewhere), which is what the
drafter sends. Ids are kept in ascending order, so "ties go to the lower index" is still "ties go
to the lower token id".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from services.draft.eagle.target_parts import TargetParts


def choose_draft_vocab(label_ids: Sequence[torch.Tensor], label_probs: Sequence[torch.Tensor], size: int,
                       vocab_size: int) -> torch.Tensor:
    """The `size` token ids with the most target probability mass over the rollouts' soft labels
    (label_ids / label_probs: [T, k] per rollout), ascending; fewer when fewer were ever labelled."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, probs in zip(label_ids, label_probs, strict=True):
        mass.index_add_(0, ids.reshape(-1), probs.reshape(-1).double())
    seen = int((mass > 0).sum())
    order = torch.sort(mass, descending=True, stable=True).indices  # ties: the lower id first
    return torch.sort(order[:min(size, seen)]).values  # [V'] int64 ascending


class DraftOutput(nn.Module):
    """features [..., hidden] (after the target's final norm) -> draft logits [..., V'] float32, V'
    the draft vocabulary's size (the whole vocabulary when `vocab` is None)."""

    def __init__(self, parts: TargetParts, vocab: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                 fast: bool = False) -> None:
        """`fast`: multiply with specmesh's bf16 CPU kernel where it builds (serving: the rows are
        few, and torch's own bf16 linear takes a slow path without native bf16); training and
        the float32 exactness tests keep torch's linear."""
        super().__init__()
        self.softcap = parts.softcap
        full = parts.lm_head.weight.detach()  # [vocab, hidden]
        self.register_buffer("vocab", None if vocab is None else vocab.to(full.device, torch.long))
        weight = full if vocab is None else full[self.vocab]  # [V', hidden]
        self.size = int(weight.shape[0])
        linear = nn.Linear(weight.shape[1], self.size, bias=False, device=full.device, dtype=dtype)
        linear.weight.data.copy_(weight)
        linear.requires_grad_(False)
        self.linear = _fast(linear) if fast and dtype == torch.bfloat16 else linear

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., V'] float32
        logits = self.linear(features).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices [...] -> token ids [...]."""
        return indices if self.vocab is None else self.vocab[indices.to(self.vocab.device)]

    def index_of(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] int64: each token id's draft-vocabulary index, -1 outside it (training labels)."""
        if self.vocab is None:
            return torch.arange(vocab_size)
        out = torch.full((vocab_size,), -1, dtype=torch.long)
        out[self.vocab.cpu()] = torch.arange(self.size)
        return out


def _fast(linear: nn.Linear) -> nn.Module:
    from services.target.kernels import cpu_linear
    if not cpu_linear.available():
        return linear
    from services.target.model.linear import AVX512LinearBF16
    return AVX512LinearBF16(linear)
