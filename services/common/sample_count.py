"""Checks of a request's sample count (SamplingParams.n), shared by the router and the target.

n = 0 or 1 is one sample. With a seed, sample i is seeded with seed + i
(services/target/engine/samples.py), so that sum must stay a valid uint64 seed.
"""

from __future__ import annotations

MAX_SEED = (1 << 64) - 1  # SamplingParams.seed is uint64


def num_samples(n: int) -> int:
    return max(n, 1)


def sample_count_violations(n: int, seed: int | None, limit: int) -> list[tuple[str, str]]:
    """(field, problem) pairs, fields named as in the request (empty when valid)."""
    if n < 0 or n > limit:
        return [("sampling.n", f"sampling.n must be in 0..{limit} (0 or 1 = one sample), got {n}")]
    if seed is not None and seed + num_samples(n) - 1 > MAX_SEED:
        return [("sampling.seed", f"sampling.seed {seed} + sample index {n - 1} exceeds the largest seed "
                 f"{MAX_SEED} (sample i is seeded with seed + i)")]
    return []
