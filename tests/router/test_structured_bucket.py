"""Requests with a constraint form the `structured` bucket, whose plan names grammar drafts."""

from __future__ import annotations

from services.common.sampling_params import SamplingConfig
from services.router.buckets import bucket_of
from services.router.speculation_policy import acceptance_prior, structured_method

GREEDY = SamplingConfig(max_tokens=8)


def test_a_constraint_puts_the_request_in_the_structured_bucket():
    assert bucket_of("def f(x):\n    return x", GREEDY, structured=True) == "structured-short-greedy"
    assert bucket_of("def f(x):\n    return x", GREEDY) == "code-short-greedy"
    assert acceptance_prior("structured-short-greedy") > acceptance_prior("chat-short-greedy")


def test_the_structured_plan_is_grammar_drafts_unless_speculation_is_off():
    assert structured_method("prompt_lookup", "structured-short-greedy") == "grammar"
    assert structured_method("suffix", "structured-long-sampled") == "grammar"
    assert structured_method("off", "structured-short-greedy") == "off"
    assert structured_method("prompt_lookup", "chat-short-greedy") == "prompt_lookup"
    assert structured_method("grammar", "chat-short-greedy") == "off"  # only constrained requests
