"""The step-cost curve re-estimated from the decode loop's own step times (runtime/cost_meter.py)."""

from __future__ import annotations

import numpy as np
import pytest
from specdeploy.runtime import load
from specdeploy.runtime.cost_meter import StepCostMeter
from specdeploy.runtime.decode import GenerationConfig
from specdeploy.runtime.tree_cost import step_cost

PRIOR = {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0, 16: 3.0}


def _feed(meter: StepCostMeter, cost, steps: int, seed: int = 0, noise: float = 0.05) -> int:
    """``steps`` steps of 1-5 nodes (1 node on every 8th), each ``cost(n)`` ms with multiplicative noise;
    returns how many re-estimates changed the curve."""
    rng = np.random.default_rng(seed)
    changed = 0
    for i in range(steps):
        n = 1 if i % 8 == 0 else int(rng.integers(2, 6))
        changed += meter.add(n, cost(n) * 1e-3 * float(rng.lognormal(0.0, noise)))
    return changed


def test_the_curve_converges_to_the_loops_step_costs():
    meter = StepCostMeter(PRIOR)
    assert _feed(meter, lambda n: 8.0 * (1 + 0.08 * (n - 1)), 600) > 0
    curve = meter.curve
    for n in (2, 3, 4, 5):
        assert curve[n] == pytest.approx(1 + 0.08 * (n - 1), abs=0.03)
    # Beyond the largest count measured (5), the prior's points scaled as the measured ones are.
    scale = float(np.median([curve[n] / step_cost(PRIOR, n) for n in (2, 3, 4, 5)]))
    assert curve[8] == pytest.approx(PRIOR[8] * scale, abs=1e-3) and curve[16] == pytest.approx(PRIOR[16] * scale, abs=1e-3)
    assert curve[1] == 1.0 and list(curve.values()) == sorted(curve.values())


def test_too_few_samples_keep_the_prior():
    meter = StepCostMeter(PRIOR, min_samples=12, every=4)
    for _ in range(11):  # 11 one-node steps: not yet enough to divide by
        assert meter.add(1, 0.008) is False
        assert meter.add(2, 0.004) is False  # half the cost: would be a big change if it counted
    assert meter.curve == PRIOR and meter.updates == 0


def test_the_curve_never_falls_with_more_nodes():
    meter = StepCostMeter(PRIOR, min_samples=4, every=4)
    costs = {1: 8.0, 2: 9.0, 3: 8.5, 4: 9.5, 5: 9.2}  # noisy medians: 3 and 5 below their left neighbours
    for _ in range(8):
        for n, ms in costs.items():
            meter.add(n, ms * 1e-3)
    values = [meter.curve[n] for n in sorted(meter.curve)]
    assert values == sorted(values)
    assert meter.curve[3] == meter.curve[2] == pytest.approx(9.0 / 8.0, abs=1e-4)


def test_old_steps_leave_the_window():
    meter = StepCostMeter(PRIOR, window=256)
    _feed(meter, lambda n: 8.0 * (1 + 0.3 * (n - 1)), 512)  # a steep spell ...
    assert meter.curve[2] == pytest.approx(1.3, abs=0.05)
    _feed(meter, lambda n: 8.0 * (1 + 0.05 * (n - 1)), 512, seed=1)  # ... then a flat one
    assert meter.curve[2] == pytest.approx(1.05, abs=0.03)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="1-node point"):
        StepCostMeter({2: 1.1})
    with pytest.raises(ValueError):
        StepCostMeter(PRIOR, window=0)


def test_the_engine_feeds_the_loops_curve_to_the_drafter(tiny_bundle):
    text = "one two three four one two three four one two three four one two"
    with load(tiny_bundle, draft="prompt-lookup") as spec, load(tiny_bundle, draft=None) as plain:
        assert plain.decoder.cost_meter is None  # plain decoding sizes nothing by cost
        meter = spec.decoder.cost_meter
        assert meter is not None and meter.prior == spec.cost_curve  # the load-time curve is the prior
        meter.min_samples, meter.every = 1, 1
        given = []
        drafter = spec.decoder.drafter
        use = drafter.use_cost_curve
        drafter.use_cost_curve = lambda curve: (given.append(dict(curve)), use(curve))
        ids = plain.encode(text)
        ref = plain.generate_ids(ids, GenerationConfig(40))
        assert spec.generate_ids(ids, GenerationConfig(40)) == ref
        assert given and given[-1] == meter.curve and meter.updates == len(given)
        assert drafter._cost[1] == pytest.approx(step_cost(meter.curve, 2))  # what the drafter sizes by
