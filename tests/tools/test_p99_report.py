"""The P99 benchmark's report: the step cost model the target fitted on the machine it ran on
(what the per-step depth was priced with), read from a real engine; the noise-floor arm."""

from __future__ import annotations

import sys

import pytest

from benchmarks.p99_incident import ARMS, DEFAULT_ARMS, _args, calibration, round_order, step_cost
from tests.target.test_engine_serving import _engine


def test_the_report_states_the_step_cost_the_target_fitted(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    try:
        assert step_cost(engine) is None  # nothing measured yet: nothing to report
        cost = engine.speculator.load.cost
        for tokens, rows, trees in ((1, 1, 0), (10, 10, 0), (100, 1, 0), (100, 100, 0), (24, 24, 4)):
            cost.observe(tokens, 0.02 + 0.0005 * tokens + 0.002 * rows + 0.003 * trees, rows, trees)
        engine.speculator.load.observe_draft(0.0015)
        fitted = step_cost(engine)
    finally:
        engine.shutdown()
    assert fitted == {"step_ms": pytest.approx(20.0), "per_token_ms": pytest.approx(0.5),
                      "per_logit_row_ms": pytest.approx(2.0), "per_tree_ms": pytest.approx(3.0),
                      "draft_call_ms": pytest.approx(1.5)}

    class Args:  # the report's view of the run's arguments
        step_cost = fitted
    assert calibration({}, Args()) == ["Step cost the target fitted here (t = a + b·tokens + c·logit rows + "
                                       "e·trees): a 20.0 ms, b 0.50, c 2.00, e 3.00 ms; draft call 1.50 ms"]


def test_a_second_off_arm_runs_only_when_asked(monkeypatch):
    """off_again is off under another name: its ratio to off is the benchmark's noise floor."""
    assert ARMS["off_again"] == ARMS["off"] and "off_again" not in DEFAULT_ARMS
    monkeypatch.setattr(sys, "argv", ["p99_incident.py", "--arms", "off", "off_again", "adaptive"])
    assert _args().arms == ["off", "off_again", "adaptive"]
    monkeypatch.setattr(sys, "argv", ["p99_incident.py", "--arms", "of"])
    with pytest.raises(SystemExit):  # a misspelt arm is refused, not silently dropped
        _args()


def test_the_arms_take_turns_in_a_rotating_order():
    arms = ["off", "adaptive", "off_again"]
    orders = [round_order(arms, r) for r in range(4)]
    assert orders == [arms, ["adaptive", "off_again", "off"], ["off_again", "off", "adaptive"], arms]
    assert {o[0] for o in orders[:3]} == set(arms)  # each arm goes first once every len(arms) rounds
