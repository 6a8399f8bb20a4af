"""Rank 0 of a tensor-parallel target starts the other ranks (one process each), joins them in
the process groups, watches them, and stops them.

Rank 0 is the target's own process: it runs the gRPC server, the scheduler, the block manager and
sampling, and sends each step's plan to the others (services/target/model/model_runner.py); the
others run services/target/tp/follower.py. A rank process that exits while the target serves
marks the group lost at once (`Ranks` watches them), so an idle target reports NOT_SERVING too,
not only one whose next collective fails.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from services.target.config import EngineConfig
from services.target.tp.group import TensorParallel

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 60.0  # a forward's collective waiting longer than this fails the step (rank lost)
START_TIMEOUT = timedelta(seconds=120)  # the ranks joining the store
_WATCH_PERIOD_S = 0.1
_ROOT = str(Path(__file__).resolve().parents[3])  # the checkout whose `services` the ranks import


class Ranks:
    """Rank 0's handle on the other ranks: the group and their processes."""

    def __init__(self, tp: TensorParallel, store: dist.Store, procs: list[subprocess.Popen]) -> None:
        self.tp = tp
        self._store = store  # the master store lives as long as the group
        self.procs = procs  # procs[i] is rank i + 1
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="specmesh-tp-watch", daemon=True)
        self._watcher.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Tells the ranks to leave (unless the group is lost), waits up to `timeout`, then kills."""
        self._stopping.set()
        if self.tp.lost is None:
            from services.target.model.step_plan import stop_message
            try:
                self.tp.send_step(stop_message())
            except Exception:
                log.warning("tensor parallel: the stop message did not reach every rank; killing them")
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        self._stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def _watch(self) -> None:
        while not self._stopping.wait(_WATCH_PERIOD_S):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping.is_set():
                    self.tp.lose(f"rank {rank} exited with status {code}")
                    return


def start_ranks(config: EngineConfig) -> Ranks:
    """Starts ranks 1 .. N-1 of `config.tensor_parallel` and joins them as rank 0 (blocks until
    every rank has joined; their models load afterwards, alongside rank 0's)."""
    world = config.tensor_parallel
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=START_TIMEOUT, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (_ROOT, os.environ.get("PYTHONPATH")))),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}  # each rank as many threads as rank 0
    procs = []
    try:
        for rank in range(1, world):
            args = json.dumps(dict(rank=rank, world=world, port=store.port, timeout_s=COLLECTIVE_TIMEOUT_S,
                                   threads=torch.get_num_threads(), **follower_fields(config)))
            procs.append(subprocess.Popen([sys.executable, "-m", "services.target.tp.follower", args],
                                          env=env, cwd=_ROOT))
        tp = TensorParallel(0, world, store, config.device, COLLECTIVE_TIMEOUT_S)
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
    log.info("tensor parallel: %d ranks joined (rank 0 pid %d, others %s)", world, os.getpid(),
             [p.pid for p in procs])
    return Ranks(tp, store, procs)


def follower_fields(config: EngineConfig) -> dict:
    """What another rank needs to load its shard and size its KV pool, as JSON values."""
    return dict(model_dir=str(config.model_dir), dtype=config.dtype, device=config.device, weights=config.weights,
                kv_dtype=str(config.torch_kv_dtype).removeprefix("torch."), kernels=config.kernels,
                num_blocks=config.num_blocks, block_size=config.block_size)
