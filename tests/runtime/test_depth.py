"""The chain policy: calibrated draft confidence against measured costs decides how deep a chain goes."""

from __future__ import annotations

import numpy as np
import pytest
from specdeploy.runtime.drafters.depth import CallTimer, ChainPolicy, ConfidenceCalibration, CostAwareGate


def test_calibration_starts_from_the_draft_and_learns_from_verdicts():
    cal = ConfidenceCalibration(depth=3, bands=10)
    assert cal.chance(0, 0.93) == pytest.approx(0.95)  # the band's centre: the draft at its word
    assert cal.typical(2) == pytest.approx(2 / 3)  # untried depths look promising
    for _ in range(50):  # a draft that is always wrong at 0.9 confidence, right at depth 2 when it gets there
        cal.update([0.93, 0.5], accepted=0)
    assert cal.chance(0, 0.93) < 0.05
    assert cal.chance(0, 0.35) == pytest.approx(0.35)  # other bands untouched
    assert cal.seen[1].sum() == 0  # a depth after the first rejection learns nothing
    cal.update([0.35, 0.55, 0.15], accepted=2)  # accepted, accepted, rejected
    assert cal.seen[0, 3].tolist() == [1, 0] and cal.seen[1, 5].tolist() == [1, 0] and cal.seen[2, 1].tolist() == [0, 1]
    np.testing.assert_allclose(cal.chain([0.93, 0.55]), np.cumprod([cal.chance(0, 0.93), cal.chance(1, 0.55)]))
    with pytest.raises(ValueError):
        ConfidenceCalibration(depth=0)


def _policy(curve, call_cost: float, depth: int = 4) -> ChainPolicy:
    policy = ChainPolicy(depth, curve)
    policy.timer.call_s, policy.timer.step_s = call_cost, 1.0
    return policy


def test_length_weighs_each_rows_cost_against_its_chance():
    free = _policy({1: 1.0, 64: 1.0}, 0.0)
    assert free.length([0.95, 0.85, 0.55, 0.15], calls=1) == 4  # rows cost nothing: verify every token
    steep = _policy({1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}, 0.0)
    assert steep.length([0.95, 0.85, 0.55, 0.15], calls=1) == 0  # a row costs a whole step: plain step
    curve = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}
    mid = _policy(curve, 0.0)
    assert mid.length([0.95, 0.95, 0.05, 0.95], calls=1) == 2  # a weak link ends what is worth verifying
    tree = mid.chain(np.array([5, 7]), np.array([11, 12, 13, 14]), np.array([0.95, 0.95, 0.05, 0.95]), 1, max_nodes=8)
    assert tree.tokens.tolist() == [7, 11, 12] and tree.parents.tolist() == [-1, 0, 1]
    assert mid.chain(np.array([7]), np.array([11, 12, 13, 14]), np.array([0.95] * 4), 1, max_nodes=3).num_nodes == 3


def test_another_call_only_when_a_deeper_chain_pays_for_it():
    curve = {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 5: 1.08}
    assert _policy(curve, 0.05).another_call([0.95], calls=1)
    assert not _policy(curve, 0.05).another_call([0.05], calls=1)  # the chain is already lost
    assert not _policy(curve, 2.0).another_call([0.95], calls=1)  # a call costs two steps
    assert not _policy(curve, 0.0).another_call([0.95] * 4, calls=4)  # no head left


def test_the_policy_learns_a_draft_that_is_overconfident():
    curve = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2}
    policy = _policy(curve, 0.05)
    assert policy.length([0.95, 0.95], calls=2) == 2
    for _ in range(40):
        policy.chain(np.array([1]), np.array([2, 3]), np.array([0.95, 0.95]), 2, max_nodes=8)
        policy.verdict(accepted=0)
    assert policy.length([0.95, 0.95], calls=2) == 0
    assert not policy.another_call([0.95], calls=1)


def test_call_timer_times_calls_against_the_rest_of_the_step(monkeypatch):
    clock = iter([0.0, 1.0, 10.0, 10.5])
    monkeypatch.setattr("specdeploy.runtime.drafters.depth.time.perf_counter", lambda: next(clock))
    timer = CallTimer()
    assert timer.call_cost == 0.0 and timer.catch_up_cost(100) == 0.0
    timer.stop()  # never started: nothing timed
    timer.start()  # t = 0
    timer.timed(0.25)
    timer.timed(0.5, rows=100)  # a long catch-up: part of the step's calls, not a typical call
    timer.stop()  # t = 1
    assert timer.call_s == 0.25 and timer.step_s == pytest.approx(0.25)
    assert timer.row_s == pytest.approx((0.5 - 0.25) / 100)  # timed apart: beyond a typical call, per row
    assert timer.catch_up_cost(100) == pytest.approx(1.0) and timer.catch_up_cost(8) == 0.0
    timer.start()  # t = 10
    timer.timed(0.1)
    timer.stop()  # t = 10.5
    assert timer.call_s == pytest.approx(0.9 * 0.25 + 0.1 * 0.1)
    assert timer.step_s == pytest.approx(0.9 * 0.25 + 0.1 * 0.4)
    assert timer.call_cost == pytest.approx(timer.call_s / timer.step_s)


def test_cost_aware_gate_drafts_where_it_pays_and_keeps_exploring():
    curve = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}
    gate = CostAwareGate(_policy(curve, 0.1), explore_every=4)
    assert not gate.drafts(0.95, rows=40)  # a 40-node tree costs ~5 plain steps
    assert gate.drafts(0.95)
    gate.verdict(accepted=2, drafted=3)
    assert gate.calibration.seen[0, 9].tolist() == [1, 0]
    assert not gate.drafts(0.05)  # the first token is almost surely rejected: a plain step
    gate.verdict(accepted=0, drafted=0)  # a plain step teaches nothing
    assert gate.calibration.seen[0, 0].sum() == 0
    tried = []
    for _ in range(6):
        tried.append(gate.drafts(0.05))
        gate.verdict(accepted=0, drafted=4 if tried[-1] else 0)
    assert tried == [False, False, True, False, False, False]  # explores one step in 4
    assert gate.calibration.seen[0, 0].tolist() == [0, 1]
    assert gate.decisions == {"draft": 1, "explore": 1, "plain": 7}
    for _ in range(30):  # the high band turns out never to pay
        gate.drafts(0.95)
        gate.verdict(accepted=0, drafted=3)
    assert not gate.drafts(0.95)


def test_the_token_past_a_fully_accepted_chain_is_judged_by_the_next_root():
    """A chain cut short still teaches: when all of it is accepted, the next root is the base's choice for
    the first token it left out. Only the step right after counts."""
    policy = _policy({1: 1.0, 2: 1.9, 3: 2.8}, 0.0, depth=2)  # a row costs nearly a step: nothing verified
    tree = policy.chain(np.array([4, 5, 6]), np.array([8, 9]), np.array([0.55, 0.95]), 1, max_nodes=8)
    assert tree.num_nodes == 1
    policy.verdict(accepted=0)
    assert policy.observe(np.array([4, 5, 6, 8])) == (0, True)  # the base chose 8: head 1 was right
    assert policy.calibration.seen[0, 5].tolist() == [1, 0]
    assert policy.observe(np.array([4, 5, 6, 8])) is None  # settled once
    policy.chain(np.array([4, 5, 6]), np.array([8, 9]), np.array([0.55, 0.95]), 1, max_nodes=8)
    policy.verdict(accepted=0)
    assert policy.observe(np.array([4, 5, 6, 1, 2])) is None  # not the step right after: ignored
    assert policy.calibration.seen[0, 5].tolist() == [1, 0]
    gate = CostAwareGate(policy)
    assert gate.drafts(0.95)
    policy.chain(np.array([4, 5, 6]), np.array([8, 9]), np.array([0.55, 0.95]), 1, max_nodes=8)
    policy.verdict(accepted=0)
    gate.verdict(accepted=0, drafted=0)  # drafted but verified nothing: waits for the next root
    assert gate.calibration.seen.sum() == 0
    gate.settle(policy.observe(np.array([4, 5, 6, 3])))  # the base chose 3, not 8
    assert gate.calibration.seen[0, 9].tolist() == [0, 1]
