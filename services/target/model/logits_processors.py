"""Penalties, logit bias and min_tokens: the logits a sequence samples from, per row.

One `LogitsProcessor` per sequence that asks for any of them (None otherwise, so plain and
greedy requests never pay for it). It turns raw logit rows into the logits sampled from,
in this order:
  1. logit_bias            logit[t] += bias[t]
  2. min_tokens            logit[eos] = -inf while fewer than min_tokens tokens were generated
  3. repetition_penalty    over prompt + generated tokens (transformers / vLLM): a positive
                           logit is divided by it, a negative one multiplied
  4. presence / frequency  over generated tokens (OpenAI): logit[t] -= presence * [count > 0]
                           + frequency * count
Temperature, top-k and top-p follow in the sampler (services/target/model/sampler.py).

Every row has its own history: the committed tokens (prompt, then output) plus `extras[i]`,
the tokens that row follows beyond them. A decode row has none; in a verify pass the row
of a draft node follows that node's whole root path (row 0 the root, with none), so a
penalty at depth 3 counts the draft tokens at depths 1-2 of its own path. That is what
keeps speculation lossless: each verify row is exactly the distribution the target would
sample from had the path's tokens been committed one by one.

State: counts of generated tokens and the set of prompt + generated tokens, kept sparse (the
distinct token ids, a few thousand at most, against a vocabulary of up to 262k: touching
only those keeps a penalty's cost per row near zero), caught up from the sequence's
`token_ids` (the owner) on each call, so the scheduler's append needs no hook. Path extras
are sparse corrections on top.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from services.common.sampling_params import SamplingConfig


class LogitsProcessor:
    def __init__(self, config: SamplingConfig, eos_token_ids: frozenset[int], num_prompt_tokens: int) -> None:
        self.config = config
        self.num_prompt_tokens = num_prompt_tokens
        self.eos_ids = sorted(eos_token_ids)
        self.repetition = config.repetition_penalty if config.repetition_penalty not in (0.0, 1.0) else 1.0
        self.presence = config.presence_penalty
        self.frequency = config.frequency_penalty
        self.penalizes = self.repetition != 1.0 or bool(self.presence or self.frequency)
        self._bias_ids: torch.Tensor | None = None  # [num_bias], made on the logits' device
        self._bias: torch.Tensor | None = None  # [num_bias] f32
        self._counts: Counter[int] = Counter()  # generated token -> occurrences
        self._seen: set[int] = set()  # prompt + generated tokens
        self._seen_ids: torch.Tensor | None = None  # [num_seen] int64, _seen on the logits' device
        self._count_ids: torch.Tensor | None = None  # [num_generated_distinct] int64
        self._count_values: torch.Tensor | None = None  # [num_generated_distinct] f32, their counts
        self._counted = 0  # leading token_ids already in _counts / _seen

    @classmethod
    def for_request(cls, config: SamplingConfig, eos_token_ids: frozenset[int],
                    num_prompt_tokens: int) -> "LogitsProcessor | None":
        """A processor when the request asks for penalties, bias or min_tokens; else None."""
        return cls(config, eos_token_ids, num_prompt_tokens) if config.processes_logits else None

    @property
    def masks_only(self) -> tuple[int, ...] | None:
        """The tokens this processor may set to -inf, when that is all it ever does (min_tokens
        alone: end-of-sequence while too few tokens were generated); None when it changes
        logits otherwise (bias, penalties). A greedy row under such a processor still reads only
        an argmax (services/target/engine/argmax_rows.py)."""
        if self.config.logit_bias or self.penalizes:
            return None
        return tuple(self.eos_ids) if self.config.min_tokens else ()

    def apply(self, logits: torch.Tensor, token_ids: list[int],
              extras: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """logits: [n, vocab] raw rows of this sequence -> [n, vocab] float32 processed rows.

        `token_ids`: the sequence's committed tokens (prompt then output); `extras[i]`: the
        draft tokens row i follows beyond them (None = none for every row).
        """
        x = logits.to(torch.float32, copy=True)  # [n, vocab]
        n, vocab = x.shape
        dev = x.device  # every tensor below is made there: the logits may live on a GPU
        extras = extras if extras is not None else [()] * n
        if self.config.logit_bias:
            if self._bias_ids is None:
                self._bias_ids = torch.tensor([t for t, _ in self.config.logit_bias], dtype=torch.int64, device=dev)
                self._bias = torch.tensor([b for _, b in self.config.logit_bias], dtype=torch.float32, device=dev)
            x[:, self._bias_ids] += self._bias
        if self.config.min_tokens:
            generated = len(token_ids) - self.num_prompt_tokens
            early = [i for i in range(n) if generated + len(extras[i]) < self.config.min_tokens]
            if early and self.eos_ids:
                x[torch.tensor(early, device=dev)[:, None],
                  torch.tensor(self.eos_ids, device=dev)[None, :]] = float("-inf")
        if self.penalizes:
            self._catch_up(token_ids, dev)
            rows, cols, count = _path_pairs(extras, self._counts, dev)
            before = x[rows, cols] if rows.numel() else None  # [num_pairs] values before penalties
            self._penalize_history(x)
            if before is not None:
                x[rows, cols] = self._penalize_pairs(before, count)
        return x

    # ---- helpers ------------------------------------------------------------
    def _catch_up(self, token_ids: list[int], device: torch.device) -> None:
        """Adds committed tokens not yet counted (token_ids only grows)."""
        if self._seen_ids is not None and self._counted == len(token_ids):
            return
        new = token_ids[self._counted:]
        first_output = max(self.num_prompt_tokens - self._counted, 0)
        self._seen.update(new)
        self._counts.update(new[first_output:])
        self._counted = len(token_ids)
        self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.int64, device=device)
        self._count_ids = torch.tensor(list(self._counts), dtype=torch.int64, device=device)
        self._count_values = torch.tensor(list(self._counts.values()), dtype=torch.float32, device=device)

    def _penalize_history(self, x: torch.Tensor) -> None:
        """x: [n, vocab] in place: the committed history's penalties, the same for every row;
        only the history's columns change."""
        if self.repetition != 1.0 and self._seen_ids.numel():
            v = x[:, self._seen_ids]  # [n, num_seen]
            x[:, self._seen_ids] = torch.where(v > 0, v / self.repetition, v * self.repetition)
        if (self.presence or self.frequency) and self._count_ids.numel():
            x[:, self._count_ids] -= self.frequency * self._count_values + self.presence

    def _penalize_pairs(self, before: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Values at (row, token) pairs whose token the row's draft path adds, from the values
        before any penalty; `count`: committed + path occurrences of each pair's token."""
        out = torch.where(before > 0, before / self.repetition, before * self.repetition) \
            if self.repetition != 1.0 else before  # every pair's token is in its row's history now
        return out - self.frequency * count - self.presence * (count > 0).float()


def _path_pairs(extras: Sequence[Sequence[int]], committed: Counter[int], device: torch.device,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [p], tokens [p], counts [p]): each distinct draft token of each row's path, with
    its committed generated count plus its occurrences on that path."""
    rows, cols, count = [], [], []
    for i, path in enumerate(extras):
        for token, k in Counter(path).items():
            rows.append(i)
            cols.append(token)
            count.append(committed.get(token, 0) + k)
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device),
            torch.tensor(count, dtype=torch.float32, device=device))


def tree_paths(token_ids: Sequence[int], parents: Sequence[int]) -> list[tuple[int, ...]]:
    """Draft-tree rows' extras: [()] for the root row, then node i's root path (its own token last)."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(token_ids, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (int(token),))
    return [(), *paths]


def process_rows(logits: torch.Tensor, processors: Sequence["LogitsProcessor | None"],
                 histories: Sequence[list[int]]) -> torch.Tensor:
    """logits: [num_seqs, vocab], one row per sequence -> the rows to sample from. Returns
    `logits` itself when no sequence has a processor (greedy and plain rows stay as they are)."""
    if all(p is None for p in processors):
        return logits
    out = logits.to(torch.float32, copy=True)  # [num_seqs, vocab]
    for i, (processor, history) in enumerate(zip(processors, histories)):
        if processor is not None:
            out[i:i + 1] = processor.apply(logits[i:i + 1], history)
    return out
