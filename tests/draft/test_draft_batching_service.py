"""The draft service over real gRPC on loopback, with the tiny seeded llama as its draft model:
- the sequences of one ProposeStream message (greedy and seeded sampled chains, dynamic trees)
  get the trees that single calls give them, step after step of commits and rollbacks, in one
  draft forward per depth per method instead of one per sequence and depth;
- two targets calling at once are not serialised: each call's first draft forward waits at a
  two-party barrier until the other call's forward has started too (a global lock would leave
  one waiting for the other until the barrier times out), and their recorded forward spans
  overlap; a prompt lookup answers while a draft forward is held;
- a Release of a sequence whose proposal is in flight waits for that proposal.
The draft forwards are timed (and held) by hooks on the real model."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from services.common.draft_tree import DraftTree
from services.common.server import GrpcServer, ServerConfig
from services.draft.config import DraftConfig
from services.draft.proposers.draft_model import DraftModel
from services.draft.service import SERVICE_NAME, DraftService, add_to_server
from specmesh.proto.v1 import common_pb2, draft_service_pb2, draft_service_pb2_grpc

DM = common_pb2.SPECULATION_METHOD_DRAFT_MODEL
DT = common_pb2.SPECULATION_METHOD_DYNAMIC_TREE
PL = common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP
BARRIER_TIMEOUT_S = 30.0  # a liveness bound, not a speed assertion


class DraftForwards:
    """Hooks on the draft model: records each forward's (thread, start, end) and runs `gate` at its start."""

    def __init__(self, model) -> None:
        self.spans: list[tuple[str, float, float]] = []  # (thread name, start, end)
        self.gate = None  # called in the forward's thread before it runs
        self._local = threading.local()
        self._hooks = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def _before(self, module, args) -> None:
        self._local.start = time.monotonic()  # the forward has begun (it may be held at the gate)
        if self.gate is not None:
            self.gate()

    def _after(self, module, args, out) -> None:
        self.spans.append((threading.current_thread().name, self._local.start, time.monotonic()))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


@pytest.fixture
async def served(tiny_llama_dir):
    """(stub factory, service, forwards) of a draft server on loopback."""
    draft = DraftModel.load(tiny_llama_dir, "float32")
    service = DraftService(DraftConfig(server=ServerConfig(port=0), draft_model_dtype="float32",
                                       dynamic_tree_top_k=3), draft)
    server = GrpcServer(service.config.server, lambda s: add_to_server(s, service), [SERVICE_NAME])
    await server.start()
    channels = []

    def stub():  # one channel per target
        channels.append(grpc.aio.insecure_channel(server.address))
        return draft_service_pb2_grpc.DraftServiceStub(channels[-1])

    forwards = DraftForwards(draft.model)
    yield stub, service, forwards
    forwards.remove()
    for channel in channels:
        await channel.close()
    await server.stop(0)


def _seq(sid, tokens, method=DM, depth=4, nodes=0, seed=None, temperature=0.0, top_k=0):
    message = draft_service_pb2.DraftSequence(sequence_id=sid, new_token_ids=list(tokens), method=method,
                                              max_depth=depth, max_nodes=nodes, tenant_salt="t",
                                              temperature=temperature, top_k=top_k)
    if seed is not None:
        message.seed, message.has_seed = seed, True
    return message


# Short prompts (all fed in the batched forward): greedy chains, seeded sampled chains, trees.
SEQUENCES = {
    "g1": dict(tokens=[1, 40, 41, 42, 43], method=DM, depth=4),
    "g2": dict(tokens=[1, 70, 71, 9], method=DM, depth=3),
    "s1": dict(tokens=[1, 40, 41, 42, 43], method=DM, depth=4, seed=5, temperature=0.8),
    "s2": dict(tokens=[1, 90, 12, 13, 14, 15], method=DM, depth=2, seed=6, temperature=1.2, top_k=6),
    "t1": dict(tokens=[1, 50, 51, 52], method=DT, depth=3, nodes=8),
    "t2": dict(tokens=[1, 33, 34], method=DT, depth=3, nodes=5),
}


def _path_length(tree: DraftTree) -> int:
    n = 1
    while n < tree.num_nodes and tree.parents[n] == n - 1:
        n += 1
    return n


async def _steps(stream, ids: list[list[str]], num_steps: int = 3) -> dict[str, list[DraftTree]]:
    """Per sequence its tree at each step; each step sends one message per group of `ids`, then
    commits part of each tree's first path and a token of the target's own."""
    trees: dict[str, list[DraftTree]] = {sid: [] for group in ids for sid in group}
    new = {sid: SEQUENCES[sid]["tokens"] for sid in trees}
    for step in range(num_steps):
        for group in ids:
            await stream.write(draft_service_pb2.ProposeStreamRequest(step=step, sequences=[
                _seq(sid, new[sid], **{k: v for k, v in SEQUENCES[sid].items() if k != "tokens"})
                for sid in group]))
            answer = await stream.read()
            assert [t.sequence_id for t in answer.trees] == group
            for message in answer.trees:
                trees[message.sequence_id].append(DraftTree.from_proto(message))
        for i, sid in enumerate(trees):
            tree = trees[sid][-1]
            path = list(tree.token_ids[:_path_length(tree)])
            accepted = (step + i) % (len(path) + 1)
            new[sid] = path[:accepted] + [(path[accepted] + 1) % 384 if accepted < len(path) else 7]
    return trees


async def test_one_message_of_n_sequences_gives_the_trees_of_n_single_calls(served):
    stub, service, forwards = served
    batched = await _steps(stub().ProposeStream(), [list(SEQUENCES)])
    batched_forwards = len(forwards.spans)
    forwards.spans.clear()
    # The same sequences on a fresh server state: released, then one message per sequence.
    await stub().Release(draft_service_pb2.ReleaseRequest(sequence_ids=list(SEQUENCES)))
    single = await _steps(stub().ProposeStream(), [[sid] for sid in SEQUENCES])
    for sid in SEQUENCES:
        for step, (a, b) in enumerate(zip(batched[sid], single[sid], strict=True)):
            assert (a.token_ids, a.parents) == (b.token_ids, b.parents), f"{sid} at step {step}"
            assert [d.token_ids for d in a.distributions] == [d.token_ids for d in b.distributions]
            for qa, qb in zip(a.distributions, b.distributions):
                assert qa.probs == pytest.approx(qb.probs, rel=1e-5, abs=1e-6)
    assert all(len(trees[0].distributions) == trees[0].num_nodes for sid, trees in batched.items()
               if sid.startswith("s"))
    # Per step: max depth of the chains (4) + of the trees (3) forwards, not one per sequence and depth.
    assert batched_forwards == 3 * (4 + 3)
    assert len(forwards.spans) == 3 * (4 + 3 + 4 + 2 + 3 + 3)  # one call per sequence


async def test_two_targets_calling_at_once_are_not_serialised(served):
    stub, service, forwards = served
    barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT_S)
    waited: set[str] = set()

    def gate():  # each call's first forward waits until the other call's first forward has begun
        name = threading.current_thread().name
        if name not in waited and len(waited) < 2:
            waited.add(name)
            barrier.wait()

    forwards.gate = gate
    target_a, target_b = stub(), stub()
    a = target_a.Propose(draft_service_pb2.ProposeRequest(sequences=[_seq("a1", [1, 5, 6, 7]), _seq("a2", [1, 8])]))
    b = target_b.Propose(draft_service_pb2.ProposeRequest(sequences=[_seq("b1", [1, 9, 10], method=DT, depth=3,
                                                                          nodes=6)]))
    answers = await asyncio.gather(a, b)
    forwards.gate = None
    assert [len(answer.trees) for answer in answers] == [2, 1] and not barrier.broken
    assert len(waited) == 2  # two worker threads, each holding a forward at the barrier
    first = {}
    for name, start, end in forwards.spans:
        first.setdefault(name, (start, end))
    (start_a, end_a), (start_b, end_b) = (first[name] for name in waited)
    assert start_a < end_b and start_b < end_a  # the two calls' first forwards ran at the same time


async def test_a_lookup_and_a_release_of_another_sequence_answer_while_a_draft_forward_runs(served):
    stub, service, forwards = served
    held, go = threading.Event(), threading.Event()

    def gate():
        held.set()
        if not go.wait(BARRIER_TIMEOUT_S):
            raise TimeoutError("the draft forward was never released")

    await stub().Propose(draft_service_pb2.ProposeRequest(sequences=[_seq("other", [1, 2, 3], method=PL)]))
    forwards.gate = gate
    model_call = asyncio.ensure_future(stub().Propose(draft_service_pb2.ProposeRequest(
        sequences=[_seq("m", [1, 5, 6, 7])])))
    await asyncio.to_thread(held.wait, BARRIER_TIMEOUT_S)
    assert held.is_set()
    lookup = await stub().Propose(draft_service_pb2.ProposeRequest(sequences=[_seq("p", [5, 6, 7, 5, 6],
                                                                                  method=PL)]))
    released = await stub().Release(draft_service_pb2.ReleaseRequest(sequence_ids=["other"]))
    assert not model_call.done()  # both answered while the draft forward was still held
    go.set()
    forwards.gate = None
    assert list(lookup.trees[0].token_ids) == [7, 5, 6] and released.released == 1
    assert len((await model_call).trees[0].token_ids) == 4


async def test_a_release_waits_for_its_sequence_s_proposal_in_flight(served):
    stub, service, forwards = served
    held, go = threading.Event(), threading.Event()
    forwards.gate = lambda: (held.set(), go.wait(BARRIER_TIMEOUT_S))
    model_call = asyncio.ensure_future(stub().Propose(draft_service_pb2.ProposeRequest(
        sequences=[_seq("m", [1, 5, 6, 7])])))
    await asyncio.to_thread(held.wait, BARRIER_TIMEOUT_S)
    release = asyncio.ensure_future(stub().Release(draft_service_pb2.ReleaseRequest(sequence_ids=["m"])))
    await asyncio.sleep(0.3)  # time for the Release to arrive (it must not finish before the proposal)
    assert not release.done()
    forwards.gate = None
    go.set()
    proposal, released = await model_call, await release
    assert len(proposal.trees[0].token_ids) == 4 and released.released == 1
    assert "m" not in service.store and service.proposers[DM].cache_length("m") == 0
