"""One rank's view of a tensor-parallel target: its rank, the world size, and the two process
groups every collective goes through.

  * `compute`: the forward's collectives (the all-reduce after each row-parallel projection, the
    all-gather of the vocabulary-parallel logits): gloo on the CPU, NCCL where the model is on
    CUDA; each has a timeout, so a rank that stops answering fails the step instead of hanging it.
  * `steps`: rank 0's step plans to the other ranks (services/target/model/step_plan.py), always
    gloo on host tensors. A rank waits there as long as the target is idle, so its timeout is long;
    a dead rank 0 closes the connection, which ends the wait at once.

The first failure of either marks the group lost (`lost`): every later collective raises RankLost
at once, and the callbacks of `on_lost` (the engine's) run once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from services.target.engine.engine_types import RankLost

log = logging.getLogger(__name__)
STEP_CAPACITY = 4096  # int64 entries of the step message sent in one piece; a longer plan sends the rest after
IDLE_TIMEOUT = timedelta(days=30)  # the `steps` group's: a rank waits this long for the next step


class TensorParallel:
    def __init__(self, rank: int, world: int, store: dist.Store, device: torch.device | str,
                 timeout_s: float) -> None:
        self.rank, self.world = rank, world
        self.timeout = timedelta(seconds=timeout_s)
        self.steps = dist.ProcessGroupGloo(dist.PrefixStore("steps", store), rank, world, IDLE_TIMEOUT)
        self.compute = _compute_group(dist.PrefixStore("compute", store), rank, world, device, self.timeout)
        self.lost: RankLost | None = None
        self._callbacks: list[Callable[[RankLost], None]] = []
        self._lock = threading.Lock()
        self.all_reduces = 0  # counters for benchmarks/tensor_parallel.py
        self.all_reduce_seconds = 0.0

    # ---- the forward's collectives (every rank, same order) -----------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; x: [T, hidden] contiguous."""
        start = time.perf_counter()
        self._wait(self.compute.allreduce([x]), "all-reduce")
        self.all_reduces += 1
        self.all_reduce_seconds += time.perf_counter() - start
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x: [R, V / world] this rank's columns -> [R, V], the ranks' columns side by side."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._wait(self.compute.allgather([parts], [x.contiguous()]), "all-gather")
        return torch.cat(parts, dim=-1)

    def barrier(self) -> None:
        """Every rank has arrived (after loading its shard); RankLost if one cannot."""
        ones = torch.ones(1, device=self.device_of_compute)
        self._wait(self.compute.allreduce([ones]), "start-up barrier")

    # ---- step plans: rank 0 -> the others -------------------------------------------------
    def send_step(self, message: torch.Tensor) -> None:
        """Rank 0: one plan or stop message ([length] int64, length in message[0]) to every rank."""
        head = torch.zeros(STEP_CAPACITY, dtype=torch.int64)
        n = min(len(message), STEP_CAPACITY)
        head[:n] = message[:n]
        self._wait(self.steps.broadcast([head], dist.BroadcastOptions()), "step broadcast")
        if len(message) > STEP_CAPACITY:
            self._wait(self.steps.broadcast([message[STEP_CAPACITY:].clone()], dist.BroadcastOptions()),
                       "step broadcast")

    def receive_step(self) -> torch.Tensor:
        """Another rank: rank 0's next message ([length] int64)."""
        head = torch.zeros(STEP_CAPACITY, dtype=torch.int64)
        self._wait(self.steps.broadcast([head], dist.BroadcastOptions()), "step receive")
        length = int(head[0])
        if length <= STEP_CAPACITY:
            return head[:length]
        rest = torch.zeros(length - STEP_CAPACITY, dtype=torch.int64)
        self._wait(self.steps.broadcast([rest], dist.BroadcastOptions()), "step receive")
        return torch.cat([head, rest])

    # ---- failure ----------------------------------------------------------------------------
    def on_lost(self, callback: Callable[[RankLost], None]) -> None:
        """Calls `callback(error)` once when the group is lost (at once if it is)."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._callbacks.append(callback)
        if lost is not None:
            callback(lost)

    def lose(self, reason: str) -> RankLost:
        """Marks the group lost (first reason wins) and tells the callbacks; returns the error."""
        with self._lock:
            if self.lost is not None:
                return self.lost
            self.lost = RankLost(f"tensor-parallel rank lost: {reason}; the replica stops and restarts")
            callbacks, self._callbacks = self._callbacks, []
        log.critical("%s", self.lost)
        for callback in callbacks:
            try:
                callback(self.lost)
            except Exception:
                log.exception("rank-lost callback failed")
        return self.lost

    @property
    def device_of_compute(self) -> str:
        return "cpu" if isinstance(self.compute, dist.ProcessGroupGloo) else f"cuda:{torch.cuda.current_device()}"

    def _wait(self, work, what: str) -> None:
        if self.lost is not None:
            raise self.lost
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise self.lose(f"{what} on rank {self.rank} failed ({type(exc).__name__}: {exc})") from exc


def _compute_group(store: dist.Store, rank: int, world: int, device: torch.device | str,
                   timeout: timedelta):
    """NCCL where the model is on CUDA (not testable on this machine's CPU), else gloo."""
    if torch.device(device).type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, timeout)
