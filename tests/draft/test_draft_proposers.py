"""Draft proposers without gRPC: suffix decoding, draft model chains with KV rollback,
and dynamic (EAGLE-2 style) trees, on tiny seeded models (tests/conftest.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specmesh.proto.v1 import common_pb2
from services.draft.proposers import (
    DraftModel,
    DraftModelProposer,
    DynamicTreeProposer,
    SuffixProposer,
)
from services.draft.state import DraftStateStore
from services.draft.proposers.base import DraftSampling
from transformers import DynamicCache

SUFFIX = common_pb2.SPECULATION_METHOD_SUFFIX
DM = common_pb2.SPECULATION_METHOD_DRAFT_MODEL
DT = common_pb2.SPECULATION_METHOD_DYNAMIC_TREE


class Driver:
    """Feeds committed tokens to one proposer the way the service does."""

    def __init__(self, proposer, method: int) -> None:
        self.proposer, self.method, self.store = proposer, method, DraftStateStore()

    def commit(self, sid: str, tokens, salt: str = "t"):
        state = self.store.append(sid, list(tokens), salt, self.method)
        self.proposer.observe(sid, list(tokens))
        return state

    def propose(self, sid: str, depth: int, nodes: int):
        [tree] = self.proposer.propose([self.store.get(sid)], depth, nodes)
        return tree

    def release(self, sid: str) -> None:
        self.proposer.release(sid)
        self.store.release([sid])


def tree_of(tree) -> tuple[list[int], list[int]]:
    return list(tree.token_ids), list(tree.parents)


# ---- suffix decoding ------------------------------------------------------------------------

def test_suffix_chain_and_branching_tree_exact_tokens():
    d = Driver(SuffixProposer(), SUFFIX)
    d.commit("chain", [1, 2, 3, 4, 5, 1, 2, 3])
    assert tree_of(d.propose("chain", 4, 4)) == ([4, 5, 1, 2], [-1, 0, 1, 2])
    # "6 1": only "1" occurs earlier (3 times), followed by 2 3 8 / 2 4 9 / 2 3 6.
    d.commit("branch", [7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2, 3, 6, 1])
    # 2 (count 3), then 2->3 (2) before 2->4 (1); then depth 3: 2->3->6 and 2->3->8 tie, 6 wins.
    assert tree_of(d.propose("branch", 3, 4)) == ([2, 3, 4, 6], [-1, 0, 0, 1])
    assert tree_of(d.propose("branch", 3, 8)) == ([2, 3, 4, 6, 8, 9], [-1, 0, 0, 1, 1, 2])
    assert tree_of(d.propose("branch", 3, 3)) == ([2, 3, 4], [-1, 0, 0])  # max_nodes
    assert tree_of(d.propose("branch", 2, 8)) == ([2, 3, 4], [-1, 0, 0])  # max_depth
    assert tree_of(d.propose("branch", 1, 8)) == ([2], [-1])
    # The longest matching suffix wins over more frequent shorter ones: the history now ends
    # "1 2 3 6 1 2 3 6"; "1 2 3 6" occurred once before (then 1 2 3), "3" twice more.
    d.commit("branch", [2, 3, 6])
    assert tree_of(d.propose("branch", 3, 8)) == ([1, 2, 3], [-1, 0, 1])
    d.commit("none", [1, 2, 3])
    assert tree_of(d.propose("none", 4, 8)) == ([], [])


def test_suffix_ties_by_token_id_and_most_recent_occurrences():
    d = Driver(SuffixProposer(), SUFFIX)
    d.commit("s", [1, 3, 1, 2, 1])  # "1" is followed by 3 1 2 1 and by 2 1: one each
    assert tree_of(d.propose("s", 2, 4)) == ([2, 3, 1, 1], [-1, -1, 0, 1])
    recent = Driver(SuffixProposer(max_occurrences=1), SUFFIX)
    recent.commit("s", [1, 3, 1, 2, 1])
    assert tree_of(recent.propose("s", 2, 4)) == ([2, 1], [-1, 0])  # only the latest occurrence


def test_suffix_tenant_outputs_are_shared_within_the_tenant_only():
    d = Driver(SuffixProposer(), SUFFIX)
    d.commit("a1", [10, 11, 12], salt="tenant-a")  # prompt
    d.propose("a1", 4, 4)
    d.commit("a1", [20, 21, 22, 23, 24], salt="tenant-a")  # output
    d.propose("a1", 4, 4)
    d.release("a1")  # its output joins tenant-a's corpus
    d.commit("a2", [30, 31, 21], salt="tenant-a")
    d.commit("b1", [30, 31, 21], salt="tenant-b")
    assert tree_of(d.propose("a2", 4, 4)) == ([22, 23, 24], [-1, 0, 1])  # same tenant: hit
    assert tree_of(d.propose("b1", 4, 4)) == ([], [])  # other tenant: nothing
    # The prompt of a1 is not shared, even within the tenant (only outputs are).
    d.commit("a3", [40, 10], salt="tenant-a")
    assert tree_of(d.propose("a3", 4, 4)) == ([], [])
    assert d.proposer.tenant_num_tokens("tenant-a") == 5
    assert d.proposer.tenant_num_tokens("tenant-b") == 0


def test_suffix_memory_is_capped_per_tenant_and_in_tenants():
    proposer = SuffixProposer(tenant_max_tokens=8, max_tenants=2)
    d = Driver(proposer, SUFFIX)

    def finish(sid, salt, output):
        d.commit(sid, [99], salt=salt)
        d.propose(sid, 1, 1)
        d.commit(sid, output, salt=salt)
        d.release(sid)

    finish("o1", "a", [1, 2, 3, 4])
    finish("o2", "a", [5, 6, 7, 8])
    assert proposer.tenant_num_tokens("a") == 8
    finish("o3", "a", [9, 10, 11, 12])  # over the cap: the oldest output goes
    assert proposer.tenant_num_tokens("a") == 8
    d.commit("q1", [50, 1], salt="a")
    d.commit("q2", [50, 5], salt="a")
    assert tree_of(d.propose("q1", 3, 3)) == ([], [])
    assert tree_of(d.propose("q2", 3, 3)) == ([6, 7, 8], [-1, 0, 1])
    finish("o4", "a", list(range(20, 40)))  # longer than the cap: its last 8 tokens stay
    assert proposer.tenant_num_tokens("a") == 8
    d.commit("q3", [50, 33], salt="a")  # 32..39 stay
    assert tree_of(d.propose("q3", 3, 3)) == ([34, 35, 36], [-1, 0, 1])
    d.commit("q4", [50, 31], salt="a")
    assert tree_of(d.propose("q4", 3, 3)) == ([], [])
    finish("o5", "b", [1, 2, 3])
    finish("o6", "c", [1, 2, 3])  # a third tenant: "a" (least recently used) is dropped
    assert proposer.tenant_num_tokens("a") == 0
    assert proposer.tenant_num_tokens("b") == proposer.tenant_num_tokens("c") == 3


def reference_suffix(history, outputs, depth, nodes, max_match=32):
    """Brute force: longest matching suffix over history and outputs, count the
    continuations of every occurrence in a trie, take nodes best-first."""
    texts = [history] + outputs
    best, starts = 0, []
    for text_id, text in enumerate(texts):
        for e in range(len(text) - 1):
            m = 0
            while m < min(max_match, len(history)) and m <= e and text[e - m] == history[-1 - m]:
                m += 1
            if m and m > best:
                best, starts = m, []
            if m and m == best:
                starts.append(tuple(text[e + 1:e + 1 + depth]))
    counts: dict[tuple, int] = {}
    for cont in starts:
        for k in range(1, len(cont) + 1):
            counts[cont[:k]] = counts.get(cont[:k], 0) + 1
    chosen: list[tuple] = []
    frontier = {p for p in counts if len(p) == 1}
    while frontier and len(chosen) < nodes:
        path = min(frontier, key=lambda p: (-counts[p], len(p), p))
        frontier.remove(path)
        chosen.append(path)
        frontier |= {p for p in counts if len(p) == len(path) + 1 and p[:-1] == path}
    return [p[-1] for p in chosen], [-1 if len(p) == 1 else chosen.index(p[:-1]) for p in chosen]


def test_suffix_matches_brute_force():
    rng = random.Random(5)
    for trial in range(40):
        vocab = [3, 4, 8][trial % 3]
        d = Driver(SuffixProposer(max_match=6), SUFFIX)
        outputs = []
        for k in range(trial % 3):
            out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
            d.commit(f"old{k}", [0], salt="x")
            d.propose(f"old{k}", 1, 1)
            d.commit(f"old{k}", out, salt="x")
            d.release(f"old{k}")
            outputs.insert(0, out)
        history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        d.commit("s", history, salt="x")
        depth, nodes = rng.randrange(1, 5), rng.randrange(1, 10)
        expected = reference_suffix(history, outputs, depth, nodes, max_match=6)
        assert tree_of(d.propose("s", depth, nodes)) == expected, (history, outputs, depth, nodes)


# ---- draft model: greedy chain and KV rollback -----------------------------------------------

@pytest.fixture(scope="module", params=["llama", "gemma3"])
def draft_model(request, tiny_llama_dir, tiny_gemma_dir):
    model_dir = {"llama": tiny_llama_dir, "gemma3": tiny_gemma_dir}[request.param]
    return DraftModel.load(model_dir, "float32")


def hf_greedy(draft: DraftModel, tokens, num_tokens: int) -> list[int]:
    ids = torch.tensor([list(tokens)])
    with torch.no_grad():
        out = draft.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                   do_sample=False, min_new_tokens=num_tokens)
    return out[0, len(tokens):].tolist()


PROMPTS = [[1, 40, 41, 42, 43], [1] + [(7 * i + 3) % 300 + 4 for i in range(39)]]  # 5 and 40 tokens


def test_draft_model_chain_is_the_models_greedy_continuation(draft_model):
    d = Driver(DraftModelProposer(draft_model), DM)
    for i, prompt in enumerate(PROMPTS):
        d.commit(f"s{i}", prompt)
        assert list(d.propose(f"s{i}", 6, 64).token_ids) == hf_greedy(draft_model, prompt, 6)
        assert list(d.propose(f"s{i}", 6, 3).token_ids) == hf_greedy(draft_model, prompt, 3)  # max_nodes


@pytest.mark.parametrize("accepted", [0, 2, 4, 5])
def test_draft_model_rollback_equals_from_scratch(draft_model, accepted):
    proposer = DraftModelProposer(draft_model)
    d = Driver(proposer, DM)
    prompt = PROMPTS[1]
    d.commit("s", prompt)
    chain = list(d.propose("s", 5, 5).token_ids)
    assert proposer.cached_token_ids("s") == tuple(prompt + chain[:4])  # the last draft token is never fed
    # The target accepts `accepted` draft tokens, then adds its own (a different) bonus token.
    bonus = (chain[accepted] + 1) % draft_model.vocab_size if accepted < 5 else 7
    committed = prompt + chain[:accepted] + [bonus]
    d.commit("s", chain[:accepted] + [bonus])
    kept = min(accepted, 4)  # accepted draft tokens keep their KV; the rejected one and later go
    assert proposer.cached_token_ids("s") == tuple(prompt + chain[:kept])
    assert proposer.cache_length("s") == len(prompt) + kept
    again = list(d.propose("s", 5, 5).token_ids)
    d.commit("fresh", committed)
    assert again == list(d.propose("fresh", 5, 5).token_ids) == hf_greedy(draft_model, committed, 5)
    assert proposer.cached_token_ids("s")[:len(committed)] == tuple(committed)
    assert proposer.cache_length("s") == len(committed) + 4
    _assert_same_kv(proposer, "s", "fresh")


def test_draft_model_commit_without_bonus_refeeds_the_last_token(draft_model):
    proposer = DraftModelProposer(draft_model)
    d = Driver(proposer, DM)
    d.commit("s", PROMPTS[0])
    chain = list(d.propose("s", 5, 5).token_ids)
    d.commit("s", chain[:4])  # exactly the cached tokens: their logits are needed again
    committed = PROMPTS[0] + chain[:4]
    assert list(d.propose("s", 3, 3).token_ids) == hf_greedy(draft_model, committed, 3)
    assert proposer.cache_length("s") == len(committed) + 2


def test_draft_model_release_frees_the_cache(draft_model):
    proposer = DraftModelProposer(draft_model)
    d = Driver(proposer, DM)
    state = d.commit("s", PROMPTS[0])
    d.propose("s", 3, 3)
    assert proposer.cache_length("s") == len(PROMPTS[0]) + 2
    proposer.release("s")
    assert proposer.cached_token_ids("s") == () and proposer.cache_length("s") == 0
    with pytest.raises(RuntimeError, match="observe"):
        proposer.propose([state], 3, 3)


def _assert_same_kv(proposer, a: str, b: str) -> None:
    n = min(proposer.cache_length(a), proposer.cache_length(b))
    for layer_a, layer_b in zip(proposer._kv[a].cache.layers, proposer._kv[b].cache.layers):
        torch.testing.assert_close(layer_a.keys[..., :n, :], layer_b.keys[..., :n, :], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer_a.values[..., :n, :], layer_b.values[..., :n, :], rtol=1e-4, atol=1e-5)


# ---- dynamic trees ---------------------------------------------------------------------------

def _path(build, i: int) -> list[int]:
    tokens = []
    while i != -1:
        tokens.append(build.candidate_token_ids[i])
        i = build.candidate_parents[i]
    return tokens[::-1]


@pytest.mark.parametrize("depth,nodes", [(5, 24), (4, 10), (6, 6), (6, 3)])
def test_dynamic_tree_shape_greedy_path_and_ranking(draft_model, depth, nodes):
    proposer = DynamicTreeProposer(draft_model, top_k=3)
    d = Driver(proposer, DT)
    prompt = PROMPTS[1]
    state = d.commit("s", prompt)
    build = proposer.build(state, depth, nodes)
    tree = build.tree
    assert 0 < tree.num_nodes <= nodes and max(tree.depths) <= depth
    assert all(parent < i for i, parent in enumerate(tree.parents))  # parents before children
    # The draft model's greedy chain is a root path of the tree.
    greedy = hf_greedy(draft_model, prompt, min(depth, nodes))
    node, path = -1, []
    for token in greedy:
        node = next(i for i in range(tree.num_nodes) if tree.parents[i] == node and tree.token_ids[i] == token)
        path.append(node)
    assert [build.candidate_token_ids[i] for i in build.greedy_path[:len(greedy)]] == greedy
    # Kept nodes off the greedy path rank above every dropped candidate; the tree is closed.
    kept = set(build.kept)
    dropped = [build.cumulative_probs[i] for i in range(len(build.candidate_token_ids)) if i not in kept]
    off_path = [build.cumulative_probs[i] for i in build.kept if i not in build.greedy_path]
    if dropped and off_path:
        assert min(off_path) >= max(dropped)
    assert all(build.candidate_parents[i] == -1 or build.candidate_parents[i] in kept for i in kept)
    assert proposer.cache_length("s") == len(prompt)  # tree KV was scratch


def test_dynamic_tree_probabilities_match_full_forward(draft_model):
    """Every candidate's cumulative probability equals the product of the draft model's
    probabilities computed from scratch (no cache, no tree mask) along its path; the
    40-token prompt crosses gemma3's 16-token sliding window."""
    proposer = DynamicTreeProposer(draft_model, top_k=3)
    d = Driver(proposer, DT)
    prompt = PROMPTS[1]
    build = proposer.build(d.commit("s", prompt), 4, 30)
    assert sum(build.expanded) == 3 * 3  # top_k nodes at each depth below max_depth
    probs = {}  # parent -> next-token probabilities after the prompt and the parent's path
    for i, parent in enumerate(build.candidate_parents):
        if parent not in probs:
            context = prompt + (_path(build, parent) if parent != -1 else [])
            with torch.no_grad():
                logits = draft_model.model(torch.tensor([context])).logits[0, -1].double()
            probs[parent] = torch.softmax(logits, -1)
        p = probs[parent][build.candidate_token_ids[i]].item()
        before = 1.0 if parent == -1 else build.cumulative_probs[parent]
        assert build.cumulative_probs[i] == pytest.approx(before * p, rel=1e-4)


def test_dynamic_tree_follows_commits_like_from_scratch(draft_model):
    proposer = DynamicTreeProposer(draft_model, top_k=2)
    d = Driver(proposer, DT)
    d.commit("s", PROMPTS[0])
    first = d.propose("s", 4, 8)
    new = [first.token_ids[0], (first.token_ids[1] + 5) % draft_model.vocab_size]  # accept 1, then a bonus
    d.commit("s", new)
    d.commit("fresh", PROMPTS[0] + new)
    assert tree_of(d.propose("s", 4, 8)) == tree_of(d.propose("fresh", 4, 8))
    assert proposer.cached_token_ids("s") == tuple(PROMPTS[0] + new)


# ---- draft model: sampled chains with their draft distributions -------------------------------

def _sampled_chain(draft_model, sampling, sid="s"):
    proposer = DraftModelProposer(draft_model, max_top_k=16)
    d = Driver(proposer, DM)
    d.commit(sid, PROMPTS[0])
    proposer.set_sampling(sid, sampling)
    return d.propose(sid, 5, 5)


@pytest.mark.parametrize("sampling", [DraftSampling(0.8, 0, 0.0, 3), DraftSampling(1.3, 5, 0.0, 3),
                                      DraftSampling(0.8, 0, 0.6, 3)])
def test_draft_model_samples_from_the_sparse_distribution_it_sends(draft_model, sampling):
    from services.draft.proposers.draft_model import sparse_distribution
    tree = _sampled_chain(draft_model, sampling)
    assert len(tree.distributions) == tree.num_nodes == 5
    assert tree.distribution_problem(draft_model.vocab_size) is None  # sums to 1, holds its token
    cache = DynamicCache()
    logits = draft_model.extend(cache, PROMPTS[0])
    for token, dist in zip(tree.token_ids, tree.distributions):
        ids, probs = sparse_distribution(logits, sampling, 16)  # what the node was drawn from
        assert dist.token_ids == tuple(ids.tolist())  # the batched forward's logits, to float rounding:
        torch.testing.assert_close(torch.tensor(dist.probs), probs, rtol=1e-5, atol=1e-6)
        assert len(dist.token_ids) <= (sampling.top_k or 16) and token in dist.token_ids
        logits = draft_model.extend(cache, [token])
    want = torch.softmax(draft_model.extend(DynamicCache(), PROMPTS[0]) / sampling.temperature, -1)
    first = tree.distributions[0]
    if not sampling.top_p:  # top-k of the tempered softmax, renormalised
        top = want.topk(len(first.token_ids))
        assert list(first.token_ids) == top.indices.tolist()
        assert torch.allclose(torch.tensor(first.probs), top.values / top.values.sum(), atol=1e-6)
    assert _sampled_chain(draft_model, sampling) == tree  # seeded: reproducible
    assert _sampled_chain(draft_model, replace(sampling, seed=4)) != tree


def test_draft_model_greedy_request_sends_no_distributions(draft_model):
    tree = _sampled_chain(draft_model, DraftSampling())
    assert tree.distributions == () and list(tree.token_ids) == hf_greedy(draft_model, PROMPTS[0], 5)
