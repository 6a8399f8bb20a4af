"""The router's per-bucket speculation policy."""

from __future__ import annotations

import pytest

from services.router.speculation_policy import (
    PolicyConfig,
    SpeculationPolicy,
    best_depth_for,
)

ADAPTIVE = PolicyConfig(mode="adaptive")


def test_fixed_mode_always_returns_the_configured_depth():
    policy = SpeculationPolicy(PolicyConfig(mode="fixed"), default_depth=5)
    policy.observe("b", proposed=100, accepted=0)
    assert [policy.depth("b") for _ in range(20)] == [5] * 20


def test_best_depth_grows_with_acceptance_and_is_off_when_nothing_pays():
    depths = [best_depth_for(a, ADAPTIVE)[0] for a in (0.3, 0.5, 0.7, 0.9)]
    assert depths == sorted(depths) and depths[0] < depths[-1]
    assert best_depth_for(0.9, ADAPTIVE)[0] == 10
    assert best_depth_for(0.02, ADAPTIVE)[1] < 1.0  # expected speedup below 1


def test_copy_heavy_bucket_deepens_and_creative_bucket_turns_off_with_probes():
    policy = SpeculationPolicy(ADAPTIVE, default_depth=5)
    assert policy.depth("copy") == 5  # nothing measured yet
    for _ in range(5):
        policy.observe("copy", proposed=50, accepted=45)
        policy.observe("creative", proposed=50, accepted=1)
    assert policy.depth("copy") == 10
    assert policy.acceptance("copy") == pytest.approx(0.9)
    creative = [policy.depth("creative") for _ in range(16)]
    assert creative.count(0) == 14 and creative.count(1) == 2  # off, probing every 8th


def test_small_samples_do_not_move_the_estimate():
    policy = SpeculationPolicy(ADAPTIVE, default_depth=5)
    policy.observe("b", proposed=3, accepted=0)
    assert policy.acceptance("b") is None and policy.depth("b") == 5


def test_bad_config_is_rejected():
    with pytest.raises(ValueError):
        PolicyConfig(mode="sometimes")
    with pytest.raises(ValueError):
        PolicyConfig(mode="fixed", max_depth=0)


# ---- prediction from task / temperature / length, and the target's load-aware depth ----------
def test_acceptance_is_predicted_from_task_and_temperature():
    from services.router.speculation_policy import acceptance_prior
    assert acceptance_prior("rewrite-short-greedy") == 0.75
    assert acceptance_prior("chat-short-sampled", 1.0) == pytest.approx(0.2 * 0.4)
    assert acceptance_prior("rewrite-long-greedy", 0.5) == pytest.approx(0.75 * 0.7)
    assert acceptance_prior("unknown") is None


def test_prediction_sets_the_first_depth_and_short_requests_do_not_speculate():
    policy = SpeculationPolicy(ADAPTIVE, default_depth=5)
    assert policy.depth("rewrite-short-greedy", max_tokens=64, temperature=0.0) == best_depth_for(0.75, ADAPTIVE)[0]
    assert policy.depth("rewrite-short-greedy", max_tokens=8, temperature=0.0) == 0  # tool-call sized
    creative = [policy.depth("chat-short-sampled", 64, 1.0) for _ in range(8)]
    assert creative == [0] * 7 + [1]  # predicted off; probes every 8th request
    assert policy.load_aware and not SpeculationPolicy(PolicyConfig(mode="fixed"), 5).load_aware


def test_measurement_outweighs_the_prediction_as_it_accumulates():
    policy = SpeculationPolicy(ADAPTIVE, default_depth=5)
    policy.observe("chat-short-greedy", proposed=32, accepted=31)
    # weight 32 / (32 + 32 prior tokens): halfway between 0.2 and 31/32
    depth = policy.depth("chat-short-greedy", 64, 0.0)
    assert depth == best_depth_for(0.5 * 0.2 + 0.5 * 31 / 32, ADAPTIVE)[0] > 1


def test_step_cost_model_fits_time_per_token():
    from services.common.speculation_cost import StepCostModel
    model = StepCostModel(decay=1.0, min_steps=4)
    assert not model.ready
    for n in (1, 8, 32, 4, 16, 64):
        model.observe(n, 0.01 + 0.001 * n)
    a, b, c, e = model.coefficients()  # every token a logit row here: tokens and rows share the slope
    assert model.ready and a == pytest.approx(0.01, rel=1e-9) and b + c == pytest.approx(0.001, rel=1e-9)
    assert e == 0.0  # no draft trees seen
    assert model.predict(100) == pytest.approx(0.11, rel=1e-9)


def _load_aware(a: float, b: float, draft_s: float):
    from services.common.speculation_cost import LoadAwareDepth, StepCostModel
    chooser = LoadAwareDepth(StepCostModel(decay=1.0, min_steps=2))
    for n in (1, 10, 100):
        chooser.cost.observe(n, a + b * n)
    chooser.observe_draft(draft_s)
    return chooser


def test_load_aware_depth_speculates_on_an_idle_batch_and_stops_on_a_full_one():
    # Memory-bound (a step costs about the same for 1 or 40 tokens): draft deep.
    idle = _load_aware(a=0.030, b=0.00005, draft_s=0.001)
    assert idle.choose(plain_tokens=0, plain_outputs=0, alphas=[0.8, 0.8], max_depths=[8, 8]) == [8, 8]
    # Compute-bound (every token costs): the same two sequences beside 60 decoding ones do not.
    busy = _load_aware(a=0.005, b=0.001, draft_s=0.001)
    assert busy.choose(plain_tokens=60, plain_outputs=60, alphas=[0.8, 0.8], max_depths=[8, 8]) == [0, 0]
    # Low acceptance never pays, even idle.
    assert idle.choose(plain_tokens=0, plain_outputs=0, alphas=[0.02], max_depths=[8]) == [0]
    # Before the cost model has data: the plan as asked.
    from services.common.speculation_cost import LoadAwareDepth
    assert LoadAwareDepth().choose(0, 0, [0.5], [5]) == [5]
