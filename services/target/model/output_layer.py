"""The output layer of a lean forward: hidden rows -> logits, over the whole vocabulary or, for
rows a grammar restricts to a few tokens, over those tokens only.

On the default model the tied output layer is 262,144 x 640 weights, more than half of what a
decode step reads. A constrained row at a structural position (a key, a brace, an enum value)
allows a handful of tokens: its logits elsewhere are -inf after the mask anyway, so the rows of
the allowed tokens are gathered and multiplied alone (`vocab_subsets`, computed before the
forward from the grammar's masks: services/target/structured/vocab_subsets.py), and the other
entries are set to -inf, as the mask would set them.

A row given as {row: None} is deferred: its hidden row is kept and its logits are left as zeros
(a finite stand-in) until `deferred_logits` is asked for them after the verify walk, which asks only
when the walk reaches that row (a draft leaf behind grammar-restricted rows: structured/
vocab_subsets.py). A leaf the walk does not reach then costs no pass over the whole vocabulary.

A subset row's logits are the same dot products, summed in float32 in another order than the
packed kernel's, then rounded to the layer's dtype: they can differ from the full row's in the
last bit. Whether a row is a subset row depends only on the grammar state at its position, so
the same position gets the same logits with and without speculation.
"""

from __future__ import annotations

import torch
from torch import nn


class OutputLayer:
    def __init__(self, model: nn.Module, embed: nn.Module, embed_rows=None, softcap: float | None = None) -> None:
        self.lm_head = model.lm_head
        self.softcap = softcap
        self.vocab_size = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") \
            else model.config.vocab_size
        self.weight_rows = _weight_rows(model, embed, embed_rows)  # ids [k] -> [k, hidden], or None
        self.subset_rows = 0  # rows computed over a subset since load (the engine's stats report it)
        self.subset_ids = 0  # the tokens those rows covered
        self._dtype: torch.dtype | None = None  # the logits' dtype (_logits_dtype)
        self._deferred: dict[int, torch.Tensor] = {}  # this step's deferred rows: row -> normed hidden [hidden]
        self.deferred_rows = 0  # rows deferred since load, and of those, computed after all
        self.deferred_computed = 0

    @property
    def takes_subsets(self) -> bool:
        return self.weight_rows is not None

    def __call__(self, h: torch.Tensor, vocab_subsets: dict[int, torch.Tensor | None] | None = None,
                 ) -> torch.Tensor:
        """h: [R, hidden] normed rows; vocab_subsets: {row: allowed ids [k], or None: deferred}
        -> logits [R, vocab]."""
        self._deferred = {}
        if not vocab_subsets or self.weight_rows is None:
            return self._cap(self.lm_head(h))
        self._deferred = {row: h[row].clone() for row, ids in vocab_subsets.items() if ids is None}
        self.deferred_rows += len(self._deferred)
        full = [r for r in range(h.shape[0]) if r not in vocab_subsets]
        whole = None
        if full:
            index = torch.tensor(full, dtype=torch.long, device=h.device)
            whole = self._cap(self.lm_head(h.index_select(0, index)))  # [len(full), vocab]
        # The logits' dtype is the layer's output dtype, not the hidden rows': a kernel may hand
        # back float32 logits from bf16 rows (the packed bf16 and GGUF kernels do).
        dtype = self._logits_dtype(h) if whole is None else whole.dtype
        out = torch.full((h.shape[0], self.vocab_size), float("-inf"), dtype=dtype, device=h.device)
        if whole is not None:
            out[index] = whole
        self.subset_rows += len(vocab_subsets) - len(self._deferred)
        for row in self._deferred:
            out[row] = 0.0  # zeros until deferred_logits computes the row (finite: uniform if read)
        for row, ids in vocab_subsets.items():
            if ids is None:
                continue
            self.subset_ids += ids.numel()
            ids = ids.to(h.device)
            w = self.weight_rows(ids)  # [k, hidden]
            out[row, ids] = self._cap(torch.mv(w.float(), h[row].float()).to(dtype))  # [k]
        return out

    def deferred_logits(self, row: int) -> torch.Tensor:
        """The logits [vocab] of a row the last call deferred, through the whole layer as a full
        row would be (the packed kernel's rows do not depend on the other rows of a call; where AMX
        tiles take calls of 3+ rows, this one-row call runs as a plain decode row does)."""
        self.deferred_computed += 1
        return self._cap(self.lm_head(self._deferred[row].unsqueeze(0)))[0]

    def _logits_dtype(self, h: torch.Tensor) -> torch.dtype:
        """The dtype the whole layer returns for rows like `h`, learnt once from one row."""
        if self._dtype is None:
            self._dtype = self.lm_head(h[:1]).dtype
        return self._dtype

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _weight_rows(model: nn.Module, embed: nn.Module, embed_rows):
    """ids -> the output layer's weight rows [k, hidden] in the model's dtype, where they can be
    read: a tied embedding (its table, or its GGUF blocks), or an unpacked lm_head; None when
    the only copy is packed for the kernel (every row then goes through it)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "tie_word_embeddings", False):
        if embed_rows is not None:
            return embed_rows
        weight = getattr(embed, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return lambda ids: weight.index_select(0, ids)
        return None
    lm_head = model.lm_head
    weight = getattr(lm_head, "weight", None) if isinstance(lm_head, nn.Linear) else None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and getattr(lm_head, "bias", None) is None:
        return lambda ids: weight.index_select(0, ids)
    return None
