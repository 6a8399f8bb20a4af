"""The pieces under a tensor-parallel target, without a model: the step plan's one-message encoding,
and the process groups (two real gloo ranks, one thread each in this process): plans longer than
one message's capacity, the forward's collectives, and a rank that never arrives failing the other
with RankLost within the collective timeout instead of hanging it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from services.target.engine.engine_types import RankLost
from services.target.model.step_plan import BLOCKS, SLOTS, STOP, KVCopy, StepPlan, message_kind, stop_message, tree_mask
from services.target.tp.group import STEP_CAPACITY, TensorParallel


def _plan(num_tokens: int = 5) -> StepPlan:
    return StepPlan(token_ids=list(range(10, 10 + num_tokens)), positions=list(range(num_tokens)),
                    slots=list(range(100, 100 + num_tokens)), logit_rows=[num_tokens - 1], q_lens=[2, num_tokens - 2],
                    context_lens=[7, 0], block_tables=[[3, 4], [9]], parents=[-1, 0, -1, *range(0, num_tokens - 3)],
                    copies=[KVCopy(BLOCKS, [1], [2]), KVCopy(SLOTS, [40, 41], [38, 39])])


def test_a_plan_survives_its_encoding():
    plan = _plan()
    assert StepPlan.decode(plan.encode()) == plan
    plain = StepPlan([5], [3], [12], [0], [1], [3], [[0]])
    assert StepPlan.decode(plain.encode()) == plain  # no tree, no copies
    assert message_kind(stop_message()) == STOP
    with pytest.raises(ValueError, match="not a step plan"):
        StepPlan.decode(stop_message())


def test_the_tree_mask_is_causal_for_chunks_and_ancestral_for_trees():
    # a chunk of 2 (chain) and a tree of 3: root, two children of the root
    mask = tree_mask([2, 3], [-1, 0, -1, 0, 0], "cpu")
    assert mask.tolist() == [[True, False, False], [True, True, False],
                             [True, False, False], [True, True, False], [True, False, True]]
    assert tree_mask([4], None, "cpu") is None


def _pair(timeout_s: float) -> list[TensorParallel]:
    """Ranks 0 and 1 of a real gloo group (joined from two threads: each constructor waits for the other)."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timedelta(seconds=30))
    with ThreadPoolExecutor(2) as pool:
        ranks = [pool.submit(TensorParallel, rank, 2, s, "cpu", timeout_s) for rank, s in enumerate((store, client))]
        return [r.result() for r in ranks]


def test_plans_longer_than_one_message_arrive_whole_and_collectives_sum_and_gather():
    zero, one = _pair(timeout_s=30)
    long_plan = _plan(num_tokens=STEP_CAPACITY)  # 3 lists of T alone overflow one message
    received = {}
    thread = threading.Thread(target=lambda: received.update(
        plan=StepPlan.decode(one.receive_step()), stop=one.receive_step(),
        reduced=one.all_reduce(torch.full((2, 3), 2.0)), gathered=one.all_gather(torch.tensor([[3.0, 4.0]]))))
    thread.start()
    zero.send_step(long_plan.encode())
    zero.send_step(stop_message())
    reduced = zero.all_reduce(torch.full((2, 3), 1.0))
    gathered = zero.all_gather(torch.tensor([[1.0, 2.0]]))
    thread.join(30)
    assert received["plan"] == long_plan and message_kind(received["stop"]) == STOP
    assert reduced.tolist() == received["reduced"].tolist() == [[3.0] * 3] * 2
    assert gathered.tolist() == received["gathered"].tolist() == [[1.0, 2.0, 3.0, 4.0]]
    assert zero.all_reduces == 1 and zero.all_reduce_seconds > 0


def test_a_rank_that_never_arrives_fails_the_collective_with_rank_lost_not_a_hang():
    zero, _silent = _pair(timeout_s=1.0)  # rank 1 never joins the all-reduce
    told = []
    zero.on_lost(told.append)
    start = time.monotonic()
    with pytest.raises(RankLost, match="all-reduce on rank 0 failed"):
        zero.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 20
    assert told == [zero.lost]
    with pytest.raises(RankLost):  # lost for good: at once, without waiting again
        zero.all_gather(torch.ones(1, 2))
    late = []
    zero.on_lost(late.append)  # a callback registered after the loss hears of it at once
    assert late == [zero.lost]
