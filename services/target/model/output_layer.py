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

A row given as {row: ARGMAX_ONLY} is read by nothing but a greedy argmax (the engine marks
such rows: services/target/engine/argmax_rows.py); {row: ArgmaxOnly(banned)} by a greedy argmax
after the `banned` tokens are set to -inf (min_tokens holding back end-of-sequence): masking
tokens only lowers them, so the screened row's argmax stays the masked row's unless it is a banned
token, and such a row is computed whole instead. Where the argmax screen runs (services/target/
kernels/argmax_screen.py: the layer is specmesh's bf16 or GGUF kernel, the CPU has AVX512-VNNI,
no final soft-cap), up to `screen_max_rows()` of them a step get exact logits at every token that can
be their argmax and -inf elsewhere: the same argmax, ties included, from an int8 pass over the
vocabulary and a few exact tokens instead of the whole layer. Elsewhere they are whole rows.

A subset row's logits are the same dot products, summed in float32 in another order than the
packed kernel's, then rounded to the layer's dtype: they can differ from the full row's in the
last bit. Whether a row is a subset row depends only on the grammar state at its position, so
the same position gets the same logits with and without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.target.kernels import argmax_screen, cpu_kernels, cpu_linear
from services.target.model.sampler import row_argmax


@dataclass(frozen=True)
class ArgmaxOnly:
    """A vocab_subsets value: the row's only reader is its argmax, after `banned` are set to -inf."""

    banned: tuple[int, ...] = ()


ARGMAX_ONLY = ArgmaxOnly()
# Above this many screened rows a step, the whole layer is about as fast as the screen (measured on
# the default model: docs/kernels.md; `python -m benchmarks.argmax_screen`); they go through it
# whole. 8 covers a depth-4 chain's verify pass (5 rows) and small greedy batches. With the int8
# pass on AMX-INT8 tiles, SCREEN_MAX_ROWS_AMX: the 18-request batch's rows (2-core Xeon with AMX,
# 2026-12-07, `python -m benchmarks.argmax_screen --rows 12 18 24 32`: 18 rows 17.3 ms screened
# against 19.7 whole; 24 rows 22.8 against 20.4; on another such Xeon on 2026-12-05 18 rows 17.2
# against 22.2). On the AVX2 build the whole layer widens every bf16
# weight and the screen stayed ahead at every row count measured (2-core AVX2 EPYC, 2026-12-06: 18
# rows 36.8 ms against 50.7, one row 5.5 against 7.8), so SCREEN_MAX_ROWS_AVX2 (the rows measured).
SCREEN_MAX_ROWS = 8
SCREEN_MAX_ROWS_AMX = 18
SCREEN_MAX_ROWS_AVX2 = 18


def screen_max_rows() -> int:
    if argmax_screen.amx_int8():
        return SCREEN_MAX_ROWS_AMX
    return SCREEN_MAX_ROWS_AVX2 if cpu_kernels.isa() == "avx2" else SCREEN_MAX_ROWS


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
        self.screen = _screen(self.lm_head, self.weight_rows, softcap)  # ArgmaxScreen, or None

    @property
    def takes_argmax_rows(self) -> bool:
        return self.screen is not None

    @property
    def takes_subsets(self) -> bool:
        return self.weight_rows is not None

    def __call__(self, h: torch.Tensor, vocab_subsets: dict[int, torch.Tensor | ArgmaxOnly | None] | None = None,
                 ) -> torch.Tensor:
        """h: [R, hidden] normed rows; vocab_subsets: {row: allowed ids [k], None: deferred, or an
        ArgmaxOnly marker} -> logits [R, vocab]."""
        self._deferred = {}
        screened = [r for r, ids in vocab_subsets.items() if isinstance(ids, ArgmaxOnly)] if vocab_subsets else []
        if screened and (len(screened) > screen_max_rows() or self.screen is None
                         or not bool(torch.isfinite(h[screened]).all())):
            screened = []  # whole rows (a non-finite input keeps the whole layer's NaN / inf handling)
        subsets = {r: ids for r, ids in vocab_subsets.items() if not isinstance(ids, ArgmaxOnly)} \
            if vocab_subsets and self.weight_rows is not None else {}
        screened_logits = self.screen(h.index_select(0, torch.tensor(screened, dtype=torch.long, device=h.device))) \
            if screened else None  # [len(screened), vocab], or None: the screen left them whole
        if screened_logits is None:
            screened = []
        else:
            screened, screened_logits = _without_banned_winners(screened, screened_logits, vocab_subsets)
        if not subsets and not screened:
            return self._cap(self.lm_head(h))
        if not subsets and len(screened) == h.shape[0]:  # every row screened (single-stream decode)
            return screened_logits.to(self._logits_dtype(h))
        vocab_subsets = subsets
        self._deferred = {row: h[row].clone() for row, ids in vocab_subsets.items() if ids is None}
        self.deferred_rows += len(self._deferred)
        full = [r for r in range(h.shape[0]) if r not in vocab_subsets and r not in screened]
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
        if screened:  # no soft-cap here: the screen runs only without one
            out[torch.tensor(screened, dtype=torch.long, device=h.device)] = screened_logits.to(dtype)
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


def _without_banned_winners(screened: list[int], logits: torch.Tensor, vocab_subsets: dict,
                            ) -> tuple[list[int], torch.Tensor | None]:
    """The screened rows (and their logits [len(screened), vocab]) whose argmax is none of the
    tokens their marker bans; the others are left to the whole layer (None: none is left)."""
    if not any(vocab_subsets[r].banned for r in screened):
        return screened, logits
    winners = row_argmax(logits).tolist()  # first index of the max, as the whole row's (the sampler's C++ pass)
    keep = [i for i, (r, token) in enumerate(zip(screened, winners)) if token not in vocab_subsets[r].banned]
    if len(keep) == len(screened):
        return screened, logits
    return [screened[i] for i in keep], (logits[keep] if keep else None)


def _screen(lm_head: nn.Module, weight_rows, softcap: float | None):
    """The argmax screen of this layer, where it gives the layer's own argmax: the layer is
    specmesh's bf16 kernel without a bias or its GGUF kernel (its rows read from a tied table, the
    GGUF blocks or the kernel's panels), no soft-cap (a cap applied in float32 could tie two logits
    the bf16 margin keeps apart), and the CPU runs it."""
    from services.target.model.gguf_weights import GGUFLinear
    from services.target.model.linear import AVX512LinearBF16
    packed = isinstance(lm_head, AVX512LinearBF16) and not lm_head.has_bias
    if not (packed or isinstance(lm_head, GGUFLinear)) or softcap is not None \
            or argmax_screen.unavailable_reason(lm_head.in_features) is not None:
        return None
    if weight_rows is None and packed:  # untied: the rows read back from the kernel's own panels
        def weight_rows(ids):
            return cpu_linear.panel_rows(lm_head.panels, ids, lm_head.in_features)
    if weight_rows is None:
        return None
    return argmax_screen.ArgmaxScreen(lambda ids: weight_rows(ids).to(torch.bfloat16), lm_head.out_features,
                                      lm_head.in_features)


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
