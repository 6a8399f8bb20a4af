"""Answer confidence from the target's own logits, for the router's confidence escalation.

Per committed token: the log-probability of the chosen token and the margin between the
top-1 and top-2 log-probabilities, both from the raw logits (before temperature, top-k,
top-p). Only requests that ask for it (`report_confidence`) pay the two passes over the
vocabulary (logsumexp and top-2); the rest of the engine never sees this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Confidence:
    """Running sums over a request's committed tokens."""

    count: int = 0
    sum_logprob: float = 0.0
    min_logprob: float = 0.0
    sum_margin: float = 0.0

    def add(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """logits: [n, vocab] rows that chose `tokens` ([n])."""
        logprobs, margins = token_confidence(logits, tokens)
        if not logprobs:
            return
        self.min_logprob = min(logprobs) if self.count == 0 else min(self.min_logprob, *logprobs)
        self.count += len(logprobs)
        self.sum_logprob += sum(logprobs)
        self.sum_margin += sum(margins)

    def add_tree(self, rows: torch.Tensor, proposal, path: list[int], bonus: int) -> None:
        """rows: [1 + num_nodes, vocab] of a verify pass; `path` accepted node indices, then `bonus`.

        Node i is row i + 1; a node's token was chosen by its parent's row (the root is row 0).
        """
        chooser = [0, *(node + 1 for node in path)]  # rows that chose path tokens, then the bonus
        self.add(rows[chooser], [*(proposal.token_ids[node] for node in path), bonus])

    @property
    def mean_logprob(self) -> float:
        return self.sum_logprob / self.count if self.count else 0.0

    @property
    def mean_margin(self) -> float:
        return self.sum_margin / self.count if self.count else 0.0


def token_confidence(logits: torch.Tensor, tokens: list[int]) -> tuple[list[float], list[float]]:
    """logits: [n, vocab], tokens: [n] -> (log p(token) per row, top1 - top2 log-prob per row).

    Non-finite values (a row with NaN logits) are left out rather than poisoning the means.
    """
    rows = logits.float()  # [n, vocab]
    lse = torch.logsumexp(rows, dim=-1)  # [n]
    chosen = rows.gather(-1, torch.tensor(tokens, dtype=torch.int64, device=rows.device).unsqueeze(-1)).squeeze(-1)  # [n]
    top2 = torch.topk(rows, min(2, rows.shape[-1]), dim=-1).values  # [n, 2]
    margin = top2[:, 0] - top2[:, -1]  # [n]; log-softmax shifts both by lse
    out_lp, out_margin = [], []
    for lp, m in zip((chosen - lse).tolist(), margin.tolist()):
        if math.isfinite(lp) and math.isfinite(m):
            out_lp.append(lp)
            out_margin.append(m)
    return out_lp, out_margin
