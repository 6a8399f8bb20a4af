"""Confidence escalation: when is a held answer not good enough.

The target reports, for requests that ask (`report_confidence`), the mean and minimum
log-probability of the chosen tokens and the mean top-1/top-2 log-probability margin
(Usage fields). A pool's answer is below threshold when its mean log-probability is
below `min_mean_logprob` or its mean margin below `min_margin` (mesh config). An empty
answer (no completion tokens) says nothing and is kept.
"""

from __future__ import annotations

from services.common.mesh_config import PoolConfig


def below_threshold(pool: PoolConfig, usage) -> bool:
    if usage.completion_tokens == 0:
        return False
    return usage.mean_logprob < pool.min_mean_logprob or usage.mean_margin < pool.min_margin
