"""The draft model drafts every sequence of a batch in one forward per depth (BatchedForward):
the trees equal those of single calls over several steps of commits and rollbacks, each
sequence's KV equals a cache built from scratch, and one batch costs one draft forward per
depth. Tiny seeded llama and gemma3 models (gemma3's 16-token sliding window is crossed by
the 40-token prompt; it is longer than BATCHED_FEED, so it is partly prefilled alone)."""

from __future__ import annotations

import pytest
import torch

from services.draft.proposers import DraftModel, DraftModelProposer, DynamicTreeProposer
from services.draft.proposers.base import DraftSampling
from services.draft.proposers.draft_model import BATCHED_FEED
from tests.draft.test_draft_proposers import DM, DT, PROMPTS, Driver, _assert_same_kv, tree_of

PROMPTS3 = {"a": PROMPTS[0], "b": PROMPTS[1], "c": [1] + [(11 * i + 5) % 300 + 4 for i in range(11)]}
assert len(PROMPTS[1]) > BATCHED_FEED
CHAIN_LIMITS = {"a": (4, 4), "b": (3, 64), "c": (5, 2)}  # (max_depth, max_nodes): chains of 4, 3 and 2
TREE_LIMITS = {"a": (4, 10), "b": (3, 6), "c": (5, 12)}
SAMPLING = {"a": DraftSampling(0.8, 0, 0.0, 11), "b": DraftSampling(1.1, 5, 0.0, 12),
            "c": DraftSampling(0.8, 0, 0.7, 13)}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def draft_model(request, tiny_llama_dir, tiny_gemma_dir):
    model_dir = {"llama": tiny_llama_dir, "gemma3": tiny_gemma_dir}[request.param]
    return DraftModel.load(model_dir, "float32")


def _run(proposer, method, limits, batched: bool, sampling=None, steps: int = 4):
    """Trees per step (dict sequence id -> tree). Each step the target accepts a different number
    of the first path's tokens per sequence, then adds its own (a different) token."""
    d = Driver(proposer, method)
    for sid, prompt in PROMPTS3.items():
        d.commit(sid, prompt)
        if sampling:
            proposer.set_sampling(sid, sampling[sid])
    history = []
    for step in range(steps):
        states = [d.store.get(sid) for sid in PROMPTS3]
        depths, nodes = zip(*(limits[sid] for sid in PROMPTS3))
        if batched:
            trees = proposer.propose_batch(states, depths, nodes)
        else:
            trees = [proposer.propose_batch([s], [dd], [n])[0] for s, dd, n in zip(states, depths, nodes)]
        history.append({tree.sequence_id: tree for tree in trees})
        for i, tree in enumerate(trees):
            path = list(tree.token_ids[:_greedy_path_length(tree)])
            accepted = (step + i) % (len(path) + 1)
            bonus = (path[accepted] + 1) % proposer.vocab_size if accepted < len(path) else 7
            d.commit(tree.sequence_id, path[:accepted] + [bonus])
    return d, history


def _greedy_path_length(tree) -> int:
    """Nodes 0, 1, ... while each is its predecessor's child (chains: all; dynamic trees put their
    greedy path first)."""
    n = 1
    while n < tree.num_nodes and tree.parents[n] == n - 1:
        n += 1
    return n


def _same(history_a, history_b) -> None:
    assert len(history_a) == len(history_b)
    for step, (a, b) in enumerate(zip(history_a, history_b)):
        for sid in PROMPTS3:
            assert tree_of(a[sid]) == tree_of(b[sid]), f"step {step}, sequence {sid}"
            assert len(a[sid].distributions) == len(b[sid].distributions)
            for qa, qb in zip(a[sid].distributions, b[sid].distributions):
                assert qa.token_ids == qb.token_ids
                torch.testing.assert_close(torch.tensor(qa.probs), torch.tensor(qb.probs), rtol=1e-5, atol=1e-6)


def test_a_batch_of_greedy_chains_equals_single_calls_and_rolls_back_like_from_scratch(draft_model):
    batched, many = _run(DraftModelProposer(draft_model), DM, CHAIN_LIMITS, batched=True)
    single, one_by_one = _run(DraftModelProposer(draft_model), DM, CHAIN_LIMITS, batched=False)
    _same(many, one_by_one)
    assert all(len(many[0][sid].token_ids) == n for sid, n in (("a", 4), ("b", 3), ("c", 2)))
    proposer = batched.proposer
    for sid in PROMPTS3:  # each sequence's cache holds exactly its tokens' KV, as if built alone
        state = batched.store.get(sid)
        batched.commit(f"fresh-{sid}", state.token_ids.tolist())
        proposer.propose_batch([batched.store.get(sid), batched.store.get(f"fresh-{sid}")], [3, 3], [3, 3])
        assert proposer.cached_token_ids(sid) == proposer.cached_token_ids(f"fresh-{sid}")
        assert proposer.cache_length(sid) == len(proposer.cached_token_ids(sid))
        _assert_same_kv(proposer, sid, f"fresh-{sid}")


def test_a_batch_of_sampled_chains_equals_single_calls(draft_model):
    _, many = _run(DraftModelProposer(draft_model), DM, CHAIN_LIMITS, batched=True, sampling=SAMPLING)
    _, one_by_one = _run(DraftModelProposer(draft_model), DM, CHAIN_LIMITS, batched=False, sampling=SAMPLING)
    _same(many, one_by_one)
    assert all(len(tree.distributions) == tree.num_nodes > 0 for step in many for tree in step.values())


def test_a_batch_of_dynamic_trees_equals_single_calls(draft_model):
    batched, many = _run(DynamicTreeProposer(draft_model, top_k=3), DT, TREE_LIMITS, batched=True)
    _, one_by_one = _run(DynamicTreeProposer(draft_model, top_k=3), DT, TREE_LIMITS, batched=False)
    _same(many, one_by_one)
    assert all(many[0][sid].num_nodes == TREE_LIMITS[sid][1] for sid in PROMPTS3)
    states = [batched.store.get(sid) for sid in PROMPTS3]
    batched.proposer.propose_batch(states, [4] * 3, [9] * 3)
    for state in states:  # tree rows were scratch: the cache holds exactly the committed tokens
        assert batched.proposer.cached_token_ids(state.sequence_id) == tuple(state.token_ids)
        assert batched.proposer.cache_length(state.sequence_id) == state.num_tokens


@pytest.mark.parametrize("proposer_class,limits", [(DraftModelProposer, (5, 5)), (DynamicTreeProposer, (4, 12))])
def test_one_draft_forward_per_depth_for_the_whole_batch(draft_model, proposer_class, limits):
    proposer = proposer_class(draft_model)
    d = Driver(proposer, DM if proposer_class is DraftModelProposer else DT)
    prompts = [[1, 20 + i, 30 + i, 40, 50 + 2 * i][: 3 + i % 3] for i in range(6)]  # 3 to 5 tokens, all fed in batch
    states = [d.commit(f"s{i}", prompt) for i, prompt in enumerate(prompts)]
    forwards = []
    hook = draft_model.model.register_forward_hook(lambda module, args, kwargs, out: forwards.append(
        kwargs["input_ids"].shape), with_kwargs=True)
    try:
        trees = proposer.propose(states, *limits)
    finally:
        hook.remove()
    assert len(forwards) == limits[0]  # max_depth forwards, not 6 x max_depth
    assert all(shape[0] == len(prompts) for shape in forwards)
    assert [max(t.depths) for t in trees] == [limits[0]] * len(prompts)
