"""Open-loop arrivals: a Poisson process at a given rate, reproducible from a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    index: int  # position in the run
    at_s: float  # seconds after the run starts
    item: int  # workload line (0-based)


def poisson_schedule(qps: float, seed: int, num_items: int, num_requests: int | None = None,
                     duration_s: float | None = None) -> list[Arrival]:
    """Exponential inter-arrival times at rate `qps`; workload lines drawn uniformly.

    Stops after `num_requests` arrivals or at `duration_s` (whichever is given; both: first).
    The same (qps, seed, num_items, limits) always gives the same schedule.
    """
    if qps <= 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests or duration_s")
    rng = random.Random(f"{seed}:{qps}")
    arrivals: list[Arrival] = []
    at = 0.0
    while num_requests is None or len(arrivals) < num_requests:
        at += rng.expovariate(qps)
        if duration_s is not None and at > duration_s:
            break
        arrivals.append(Arrival(len(arrivals), at, rng.randrange(num_items)))
    return arrivals
