"""The rows of a step whose last layer's output is read: what that layer computes beyond keys and values.

Every layer but the last feeds all its rows to the next; after the last, only the rows that give
logits are read. So the last layer needs every row's keys and values (stored in the pool for the
steps to come) but its attention, output projection, MLP and norms only for those rows: none for
a prefill chunk that is not its prompt's last, one for the last. On the default model (18 layers,
the last a global-attention one) a 2,000-token prefill skips about 4.6% of its matrix work and a
third of its global-attention work (a tenth of all its attention).

The lean forwards take it where their per-row kernels make a row's output independent of the other
rows of the call (the C++ row ops and linear kernels: batch-invariant), so a read row's output is
what the whole layer gives it, up to attention's summation order: its one row is attended as a
decode row is (services/target/kernels), a chunk's rows together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from services.target.model.attention import AttentionMetadata, paged_attention, paged_attention_rows
from services.target.model.step_plan import StepPlan


@dataclass
class OutputRows:
    rows: torch.Tensor  # [K] int64: the step's rows whose last-layer output is read, ascending
    meta: AttentionMetadata | None  # their attention over the pool (each sequence's context up to its first such row); None if K = 0

    @property
    def logit_rows(self) -> torch.Tensor:  # [K] int64: the read rows are the plan's logit rows, in order
        return torch.arange(self.rows.numel(), dtype=torch.long, device=self.rows.device)


def output_rows(plan: StepPlan, metadata: Callable[..., AttentionMetadata],
                device: torch.device | str) -> OutputRows | None:
    """The read rows of `plan` and their metadata (`metadata`: ModelRunner._metadata's signature), or
    None where the last layer needs every row anyway: every row gives logits, a tree is verified,
    or a sequence's read rows are not the last of its rows in the step (its rows after them would
    see keys only the other rows computed). Logit rows ascending, as ModelRunner.plan lists them."""
    logit_rows = plan.logit_rows
    if plan.parents is not None or len(logit_rows) == len(plan.token_ids):
        return None
    rows, slots, positions, q_lens, context_lens, tables = [], [], [], [], [], []
    start = at = 0
    for s, n in enumerate(plan.q_lens):
        end, first = start + n, at
        while at < len(logit_rows) and logit_rows[at] < end:
            at += 1
        k = at - first
        if k:
            if logit_rows[first] != end - k or logit_rows[at - 1] != end - 1:
                return None  # read rows that are not the sequence's last
            rows.extend(range(end - k, end))
            slots.extend(plan.slots[end - k:end])
            positions.extend(plan.positions[end - k:end])
            q_lens.append(k)
            context_lens.append(plan.context_lens[s] + n - k)
            tables.append(plan.block_tables[s])
        start = end
    if at != len(logit_rows) or rows != logit_rows:
        return None  # not ascending, or read rows the plan's logit rows do not list in that order
    meta = metadata(slots, positions, q_lens, context_lens, tables, None) if rows else None
    return OutputRows(torch.tensor(rows, dtype=torch.long, device=device), meta)


def attend_rows(meta: AttentionMetadata, read: OutputRows | None, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, scale: float, sliding_window: int | None, h: torch.Tensor, logit_rows: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A lean forward layer's paged attention: every row's (read None), or past the keys and values
    only the read rows'. -> (attention [rows, H, D], h [rows, hidden] and logit rows of the rows that
    go on)."""
    if read is None:
        return paged_attention(meta, layer, q, k, v, scale, sliding_window), h, logit_rows
    a = paged_attention_rows(meta, read.rows, read.meta, layer, q, k, v, scale, sliding_window)
    return a, h.index_select(0, read.rows), read.logit_rows
