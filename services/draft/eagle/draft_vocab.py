"""The head's draft vocabulary (EAGLE-3's reduced vocabulary, arXiv 2503.01840 section 3): the
tokens the target most often writes in the training rollouts. The head scores only
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

from services.draft.eagle.head import fast_bf16_linear
from services.draft.eagle.target_parts import TargetParts


def choose_draft_vocab(continuations: Sequence[Sequence[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` token ids the target wrote most often in its rollouts' continuations (EAGLE-3
    counts token frequency in its training data), ascending; fewer when fewer were ever written.
    Chosen before the labels are recorded, so the labelling pass reads only these rows of the LM
    head."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in continuations:
        if len(tokens):
            ids = torch.as_tensor(list(tokens), dtype=torch.long)
            counts.index_add_(0, ids, torch.ones_like(ids))
    seen = int((counts > 0).sum())
    order = torch.sort(counts, descending=True, stable=True).indices  # ties: the lower id first
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
        self.linear = fast_bf16_linear(linear) if fast and dtype == torch.bfloat16 else linear

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
