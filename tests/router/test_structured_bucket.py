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


def test_a_grammar_plan_keeps_the_configured_depth_whatever_the_bucket_measured():
    """The bucket's measured acceptance mixes forced drafts with the free parts' drafts; the
    target prices each kind per step, so the plan only caps forced chains at the configured
    depth. A sampled bucket measured at α ≈ 0.3 got depth 2 before, cutting every forced
    chain to 2 tokens (the structured-outputs benchmark at T = 0.8)."""
    from services.router.speculation_policy import PolicyConfig, SpeculationPolicy

    policy = SpeculationPolicy(PolicyConfig(mode="adaptive"), default_depth=8)
    bucket = "structured-short-sampled"
    for _ in range(20):
        policy.observe(bucket, proposed=100, accepted=30, method="grammar")
    plan = policy.choose(bucket, max_tokens=128, temperature=0.8)
    assert plan.method == "grammar" and plan.depth == 8
    other = "chat-short-sampled"  # other methods still follow what their bucket measured
    for _ in range(20):
        policy.observe(other, proposed=100, accepted=30, method="prompt_lookup")
    assert policy.choose(other, max_tokens=128, temperature=0.8).depth < 8
