"""The per-sequence grammar state: tree masks equal masks replayed path by path, reads leave
the committed state as it was, and a forbidden token cannot be committed."""

from __future__ import annotations

import json
import random

import pytest
import torch
import xgrammar as xgr

from services.common.models.tiny import TINY_VOCAB_SIZE, build_tiny_tokenizer
from services.target.structured.grammar_state import GrammarState, GrammarViolation
from tests.structured import ORDER_SCHEMA, PERSON_SCHEMA

VOCAB = TINY_VOCAB_SIZE + 8  # logits wider than the tokenizer, as real models' often are
EOS = 2


@pytest.fixture(scope="module")
def compiler():
    tok = build_tiny_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[EOS])
    return tok, xgr.GrammarCompiler(info)


def _allowed(matcher: xgr.GrammarMatcher) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def _replay(compiled, prefix: list[int], path: list[int]) -> set[int] | None:
    """Allowed next tokens after prefix + path on a fresh matcher; None if the path is forbidden."""
    matcher = xgr.GrammarMatcher(compiled)
    for token in prefix + path:
        if matcher.is_terminated() or not matcher.accept_token(token):
            return None
    return None if matcher.is_terminated() else _allowed(matcher)


def _random_tree(rng: random.Random, compiled, prefix, size: int) -> tuple[list[int], list[int]]:
    """Mostly allowed tokens (so paths go deep), some forbidden ones and an EOS now and then."""
    tokens, parents = [], []
    for i in range(size):
        parent = rng.randrange(-1, i)
        path, node = [], parent
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        allowed = _replay(compiled, prefix, path[::-1])
        if allowed and rng.random() < 0.8:
            tokens.append(rng.choice(sorted(allowed)))
        else:
            tokens.append(rng.randrange(VOCAB))
        parents.append(parent)
    return tokens, parents


@pytest.mark.parametrize("schema", [PERSON_SCHEMA, ORDER_SCHEMA])
def test_tree_rows_are_masked_along_each_nodes_own_path(compiler, schema):
    tok, xgr_compiler = compiler
    compiled = xgr_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    rng = random.Random(0)
    for trial in range(20):
        state = GrammarState(compiled, VOCAB)
        prefix = []
        for _ in range(rng.randrange(0, 12)):  # commit a random valid prefix first
            allowed = sorted(_replay(compiled, prefix, []) - {EOS})
            if not allowed:
                break
            prefix.append(rng.choice(allowed))
            state.commit(prefix[-1])
        tokens, parents = _random_tree(rng, compiled, prefix, rng.randrange(1, 14))
        rows = torch.randn(1 + len(tokens), VOCAB)  # [1 + num_nodes, vocab]
        out = state.mask_tree(rows, tokens, parents)
        for row in range(len(tokens) + 1):
            path, node = [], row - 1
            while node != -1:
                path.append(tokens[node])
                node = parents[node]
            expected = _replay(compiled, prefix, path[::-1])
            if expected is None:  # unreachable (forbidden on its path) or after EOS: untouched
                assert torch.equal(out[row], rows[row].float())
            else:
                assert set(torch.isfinite(out[row]).nonzero().flatten().tolist()) == expected, (trial, row)
                keep = torch.isfinite(out[row])
                assert torch.equal(out[row][keep], rows[row][keep])
        # The committed state is untouched: the root's mask is still the prefix's.
        assert _allowed(state.matcher) == _replay(compiled, prefix, [])


@pytest.mark.parametrize("schema", [PERSON_SCHEMA, ORDER_SCHEMA])
def test_reachable_nodes_are_those_whose_whole_path_the_grammar_accepts(compiler, schema):
    """What the speculator keeps of a deterministic draft before the forward: the nodes
    the grammar allows on their whole path (a forbidden node's subtree goes with it), renumbered
    with their parents by DraftTree.keep."""
    from services.common.draft_tree import DraftTree

    tok, xgr_compiler = compiler
    compiled = xgr_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    rng = random.Random(1)
    pruned = 0
    for trial in range(20):
        state = GrammarState(compiled, VOCAB)
        tokens, parents = _random_tree(rng, compiled, [], rng.randrange(1, 14))
        kept = state.reachable(tokens, parents)
        for i in range(len(tokens)):
            path, node = [], i
            while node != -1:
                path.append(tokens[node])
                node = parents[node]
            matcher = xgr.GrammarMatcher(compiled)
            ok = all(not matcher.is_terminated() and matcher.accept_token(t) for t in reversed(path))
            assert (i in kept) == ok, (trial, i)
        pruned += len(tokens) - len(kept)
        assert state.num_committed == 0 and _allowed(state.matcher) == _replay(compiled, [], [])
        tree = DraftTree.from_nodes("s", tokens, parents).keep(kept)
        assert list(tree.token_ids) == [tokens[i] for i in kept]
        for new, old in enumerate(kept):  # each kept node's parent is its old parent, renumbered
            assert tree.parents[new] == (-1 if parents[old] == -1 else kept.index(parents[old]))
    assert pruned > 0, "no forbidden node drawn: nothing tested"


def test_forced_tokens_are_the_grammars_and_reading_them_changes_nothing(compiler):
    tok, xgr_compiler = compiler
    compiled = xgr_compiler.compile_json_schema(json.dumps(ORDER_SCHEMA), any_whitespace=False)
    state = GrammarState(compiled, VOCAB)
    forced = state.forced_tokens(64)
    assert tok.decode(forced) == '{"customer_account_identifier": "'[:len(tok.decode(forced))]
    assert len(forced) > 5
    assert state.forced_tokens(3) == forced[:3]
    for token in forced:
        state.commit(token)
    assert state.num_committed == len(forced)


def test_a_forbidden_token_cannot_be_committed(compiler):
    tok, xgr_compiler = compiler
    state = GrammarState(xgr_compiler.compile_grammar('root ::= "yes" | "no"'), VOCAB)
    with pytest.raises(GrammarViolation):
        state.commit(tok.convert_tokens_to_ids("x"))
    with pytest.raises(GrammarViolation):
        state.commit(EOS)  # nothing generated yet: the grammar does not accept the empty output
    out = state.mask_next(torch.zeros(2, VOCAB))
    assert torch.equal(out[0], torch.zeros(VOCAB))  # only the sampled (last) row is masked
    allowed = set(torch.isfinite(out[1]).nonzero().flatten().tolist())
    assert allowed and all(tok.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)


def test_a_fork_advances_independently(compiler):
    tok, xgr_compiler = compiler
    state = GrammarState(xgr_compiler.compile_grammar('root ::= "yes" | "no"'), VOCAB)
    fork = state.fork()
    fork.commit(tok.convert_tokens_to_ids("n"))
    assert fork.num_committed == 1 and state.num_committed == 0
    state.commit(tok.convert_tokens_to_ids("y"))  # the original still allows both answers
    with pytest.raises(GrammarViolation):
        fork.commit(tok.convert_tokens_to_ids("e"))
