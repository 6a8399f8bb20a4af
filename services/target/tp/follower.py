"""A rank other than 0 of a tensor-parallel target (started by services/target/tp/launch.py):
loads its shard of the model, allocates its KV heads' pool, and runs rank 0's step plans until a
stop message. It holds no scheduler and no block manager: every plan names slots and block ids
that rank 0's block manager chose, and this rank's KV shard uses the same ids.

Any failure ends the process (non-zero): rank 0 sees the exit, or the failed collective, and
takes its replica out of service (NOT_SERVING; its requests fail with UNAVAILABLE).

    python -m services.target.tp.follower '{"rank": 1, "world": 2, "port": ..., ...}'
"""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("specmesh.tp.follower")


@dataclass(frozen=True)
class PoolShape:
    """The size of the KV pool, which on rank 0 the block manager gives (ModelRunner reads only these)."""

    num_blocks: int
    block_size: int


def main(argv: list[str]) -> int:
    args = json.loads(argv[1])
    rank = args["rank"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    torch.set_num_threads(args["threads"])
    from services.target.model.model_runner import ModelRunner, load_model
    from services.target.model.step_plan import STOP, StepPlan, message_kind
    from services.target.tp.group import TensorParallel

    device = args["device"]
    if torch.device(device).type == "cuda":  # one device per rank
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", args["port"], args["world"], is_master=False,
                          timeout=timedelta(seconds=120))
    tp = TensorParallel(rank, args["world"], store, device, args["timeout_s"])
    model, _, spec = load_model(Path(args["model_dir"]), getattr(torch, args["dtype"]), device, args["weights"], tp=tp)
    runner = ModelRunner(model, spec, PoolShape(args["num_blocks"], args["block_size"]),
                         getattr(torch, args["kv_dtype"]), args["kernels"])
    tp.barrier()
    log.info("tensor parallel rank %d of %d ready", rank, args["world"])
    while True:
        message = tp.receive_step()
        if message_kind(message) == STOP:
            return 0
        plan = StepPlan.decode(message)
        runner.run_copies(plan.copies)
        runner.execute(plan)  # the logits are rank 0's to sample


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when rank 0's thread that started it ends (the engine's torch
    thread, which lives as long as the engine), however rank 0 ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Exception:
        log.exception("tensor parallel rank failed")
        sys.exit(1)
