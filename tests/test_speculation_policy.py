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
    policy = SpeculationPolicy(PolicyConfig(), default_depth=5)
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
        PolicyConfig(max_depth=0)
