"""Grammar drafts and speculation under a grammar, on real servers.

- With no draft service at all (prompt lookup off), a schema with long fixed keys is
  generated with more than one accepted draft token per verify pass, from the grammar's
  forced continuations alone, and the output equals decoding without speculation.
- Draft trees from a draft model (which knows nothing of the grammar) are verified under
  the grammar, node by node along each path: the output is token-identical to constrained
  decoding without speculation, drafts the grammar forbids were proposed, and not one
  accepted draft token is forbidden on its path.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from specmesh.proto.v1 import common_pb2, target_service_pb2
from tests.mesh import collect, request, start_draft, start_mesh
from tests.structured import CONSTRAINTS, ORDER_SCHEMA, PERSON_SCHEMA, valid, valid_order

ORDER = common_pb2.Constraint(json_schema=json.dumps(ORDER_SCHEMA))
PROMPTS = ["Order:", "Once upon a time", "the cat sat on the mat. the cat"]


async def _run(mesh, prompts, constraint, temperature=0.0):
    return [await collect(mesh.router_stub, request(p, 96, temperature=temperature, seed=5,
                                                    has_seed=True, constraint=constraint))
            for p in prompts]


async def test_forced_keys_are_accepted_as_grammar_drafts_without_a_draft_service(tiny_llama_dir):
    plain = await start_mesh(tiny_llama_dir)
    try:
        expected = await _run(plain, PROMPTS, ORDER)
    finally:
        await plain.stop()
    mesh = await start_mesh(tiny_llama_dir, speculation={"speculation_method": "grammar",
                                                         "speculation_depth": 12})
    try:
        assert not mesh.engine.config.draft_address  # no draft service: the target drafts alone
        results = await _run(mesh, PROMPTS, ORDER)
        sampled = await _run(mesh, PROMPTS, ORDER, temperature=0.8)
    finally:
        await mesh.stop()
    for (ids, text, last), (want, _, _) in zip(results, expected):
        assert valid_order(text) and last.finish_reason == common_pb2.FINISH_REASON_STOP, text
        assert ids == want
        usage = last.usage
        assert usage.verify_passes > 0
        assert usage.accepted_tokens / usage.verify_passes > 1.0, usage
    for ids, text, last in sampled:
        if last.finish_reason == common_pb2.FINISH_REASON_STOP:
            assert valid_order(text), text
        else:  # a sampled value may not close within max_tokens: `length`, never `stop`
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, text
        assert last.usage.accepted_tokens / last.usage.verify_passes > 1.0


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A different tiny model with the same tokenizer: it proposes what the grammar forbids."""
    from services.common.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), arch="llama", seed=7)


def _target_request(prompt: str, constraint, plan, temperature=0.0, request_id=""):
    return target_service_pb2.TargetServiceGenerateRequest(
        request_id=request_id, prompt=prompt, speculation=plan,
        sampling=common_pb2.SamplingParams(max_tokens=64, temperature=temperature, seed=3,
                                           has_seed=True, constraint=constraint))


@pytest.mark.parametrize("method,depth,nodes", [
    (common_pb2.SPECULATION_METHOD_DYNAMIC_TREE, 3, 10),  # trees
    (common_pb2.SPECULATION_METHOD_DRAFT_MODEL, 4, 0),  # chains
])
async def test_draft_trees_are_verified_under_the_grammar_along_each_path(
        tiny_llama_dir, other_draft_dir, method, depth, nodes):
    kinds = ["json_schema", "regex", "choice", "grammar"]
    draft = await start_draft(other_draft_dir)
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address)
    verified = []  # (grammar matcher at the root, proposal, accepted path) of every verify pass
    drafted = []  # (grammar matcher at the root, the draft service's tree) before the grammar prunes it
    speculator = mesh.engine.speculator
    accept, propose = speculator.accept, speculator.client.propose

    def recording_accept(seq, rows, proposal, deferred=None):
        root = seq.grammar.matcher.fork() if seq.grammar is not None else None
        accepted = accept(seq, rows, proposal, deferred)  # (path, bonus, log-probabilities)
        verified.append((root, proposal, accepted[0]))
        return accepted

    def recording_propose(requests):
        result = propose(requests)
        seqs = {s.seq_id: s for s in mesh.engine.scheduler.running}
        for seq_id, tree in (result or {}).items():
            seq = seqs.get(seq_id)
            if tree is not None and seq is not None and seq.grammar is not None:
                drafted.append((seq.grammar.matcher.fork(), tree))
        return result
    speculator.accept, speculator.client.propose = recording_accept, recording_propose
    off = common_pb2.SpeculationPlan(method=common_pb2.SPECULATION_METHOD_OFF)
    plan = common_pb2.SpeculationPlan(method=method, max_depth=depth, max_nodes=nodes)
    try:
        stub = mesh.target_stub()
        for kind in kinds:
            for prompt in PROMPTS:
                want, _, _ = await collect(stub, _target_request(prompt, CONSTRAINTS[kind], off))
                ids, text, last = await collect(stub, _target_request(prompt, CONSTRAINTS[kind], plan))
                assert ids == want, (kind, prompt)
                assert valid(kind, text) and last.finish_reason == common_pb2.FINISH_REASON_STOP
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)
    forbidden_proposed = accepted = 0
    for root, proposal in drafted:
        forbidden_proposed += len(proposal.token_ids) - len(_allowed_nodes(root, proposal))
    assert forbidden_proposed > 0, "the draft model never proposed a forbidden token: nothing tested"
    for root, proposal, path in verified:
        if root is None:
            continue
        allowed = _allowed_nodes(root, proposal)
        accepted += len(path)
        assert set(path) <= allowed, "a draft token the grammar forbids was accepted"
        if not proposal.distributions:  # deterministic drafts: forbidden nodes never reach the forward
            assert len(allowed) == len(proposal.token_ids), "a forbidden node was verified"
    assert accepted > 0


def _allowed_nodes(root: xgr.GrammarMatcher, proposal) -> set[int]:
    """Draft nodes whose whole root path the grammar allows (replayed on forks)."""
    allowed: set[int] = set()
    for i in range(len(proposal.token_ids)):
        path, node = [], i
        while node != -1:
            path.append(node)
            node = proposal.parents[node]
        matcher = root.fork()
        if all(not matcher.is_terminated() and matcher.accept_token(proposal.token_ids[n])
               for n in reversed(path)):
            allowed.add(i)
    return allowed


async def test_a_schema_compiles_once_for_all_requests_and_again_never_after_a_restart(
        tiny_llama_dir, tmp_path):
    """The compiled-grammar cache: one compile per (tokenizer, constraint), in memory and on disk."""
    schema = common_pb2.Constraint(json_schema=json.dumps(PERSON_SCHEMA))
    texts = []
    for restart in range(2):
        mesh = await start_mesh(tiny_llama_dir, grammar_cache_dir=tmp_path / "grammars")
        try:
            for prompt in PROMPTS:
                texts.append((await collect(mesh.router_stub, request(prompt, 64, constraint=schema)))[1])
            assert mesh.engine.grammars.compiles == (1 if restart == 0 else 0)
        finally:
            await mesh.stop()
    assert texts[:3] == texts[3:] and all(valid("json_schema", t) for t in texts)
    assert len(list((tmp_path / "grammars").iterdir())) == 1
