"""The acceptance replay of benchmarks/prompt_lookup_acceptance.py, on hand-made outputs (no model)."""

from __future__ import annotations

import pytest

from benchmarks.prompt_lookup_acceptance import proposer_chain, replay, tree_of_continuations

PHRASE = [11, 12, 13, 14, 15, 16, 17, 18]


def test_an_exact_repeat_commits_depth_plus_one_per_step_through_the_real_proposer():
    # The prompt holds the phrase; the output repeats it after its first token, so the draft
    # service's proposer finds every next token in the prompt.
    outputs = [([1, *PHRASE, 2], PHRASE * 2)]
    per_step, steps = replay(outputs, proposer_chain(3, 1), depth=3)
    assert steps == 4  # 15 tokens after the prefill's first: 4 + 4 + 4 + 3
    assert per_step == pytest.approx(15 / 4)


def test_nothing_to_look_up_commits_one_token_per_step():
    outputs = [([1, 2, 3], [40, 41, 42, 43, 44])]
    assert replay(outputs, proposer_chain(3, 1), depth=5) == (1.0, 4)


def test_a_tree_of_continuations_accepts_where_the_most_recent_one_diverges():
    # After "7" the prompt continues once with 8 9 and, more recently, with 5 6: the output takes 8 9.
    prompt = [7, 8, 9, 0, 7, 5, 6, 0]
    outputs = [(prompt, [7, 8, 9])]
    chain, _ = replay(outputs, proposer_chain(1, 1), depth=2)
    tree, _ = replay(outputs, tree_of_continuations(2, max_ngram=1), depth=2)
    assert chain == 1.0 and tree == 2.0  # the chain proposes 5 6; the tree's second branch 8 9
