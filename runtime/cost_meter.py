"""The step-cost curve, re-estimated from the decode loop's own steps.

Drafters that size their drafts by cost (prompt lookup, the n-gram table, the depth policy of the
model drafts) need the cost of a T-node step relative to a 1-node step. The engine measures it once
at load (:func:`~.cost_curve.measure_cost_curve`, about a second), and on a shared machine that one
measurement can be off: on one AMD EPYC, the same bundle's 2-node step measured 1.10 of
a 1-node step in two bench workers and 1.19-1.20 in two others; those two ran ~1,400 steps plainly
instead of ~400 and were the two slowest of the four runs (whether their loop's steps cost that much
was not recorded). The decode loop's steps are thousands of free samples, at the real context lengths
and in the real sequence of steps (docs/benchmarks.md, "The step cost curve").

:class:`StepCostMeter` keeps each step's time with its node count. Every ``every`` steps it takes,
over the last ``window`` steps, the median time per node count, and wherever both that count and the
1-node step have at least ``min_samples`` samples, the ratio of the two medians replaces the load-time
point. Counts never seen that often keep the load-time curve: below the largest measured count they
are interpolated between measured points; above it the load-time points are scaled by the median
ratio of measured to load-time cost over the measured counts. The curve is kept non-decreasing.
Medians over one common window of steps let neither a slow spell of the machine nor one odd step move
a ratio much.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from statistics import median

from .tree_cost import step_cost

WINDOW = 1024  # steps whose times count (in ngram decoding ~6% of them are 1-node steps)
MIN_SAMPLES = 24  # steps of a node count (and of 1 node) before its measured ratio counts
EVERY = 32  # steps between re-estimates
CHANGE = 0.01  # a re-estimate replaces the curve only where a point moved by more than this


class StepCostMeter:
    """Step times by node count; :attr:`curve` is the cost curve they give (the prior until then)."""

    def __init__(self, prior: Mapping[int, float], window: int = WINDOW, min_samples: int = MIN_SAMPLES,
                 every: int = EVERY):
        if 1 not in prior or window < 1 or min_samples < 1 or every < 1:
            raise ValueError("A step-cost meter needs a prior curve with a 1-node point and positive settings.")
        self.prior = {int(t): float(c) for t, c in prior.items()}
        self.curve: dict[int, float] = dict(self.prior)
        self.window, self.min_samples, self.every = window, min_samples, every
        self.updates = 0  # re-estimates that changed the curve
        self._times: dict[int, deque[tuple[int, float]]] = {}
        self._step = 0

    def add(self, nodes: int, seconds: float) -> bool:
        """Record one step of ``nodes`` nodes; True when this re-estimated the curve and it changed (by more
        than ``CHANGE`` somewhere)."""
        self._step += 1
        times = self._times.get(nodes)
        if times is None:
            times = self._times[nodes] = deque()
        times.append((self._step, seconds))
        if self._step % self.every:
            return False
        return self._estimate()

    def _estimate(self) -> bool:
        oldest = self._step - self.window
        medians: dict[int, float] = {}
        for nodes, times in self._times.items():
            while times and times[0][0] <= oldest:
                times.popleft()
            if len(times) >= self.min_samples:
                medians[nodes] = median(t for _, t in times)
        one = medians.pop(1, None)
        if one is None or not medians:
            return False
        curve = self._merged({n: t / one for n, t in medians.items()})
        # The drafters recompute their cost tables on every new curve: not for a move of a few 1e-4.
        if curve.keys() == self.curve.keys() and all(abs(c - self.curve[t]) <= CHANGE for t, c in curve.items()):
            return False
        self.curve = curve
        self.updates += 1
        return True

    def _merged(self, measured: dict[int, float]) -> dict[int, float]:
        """The measured points, and the prior's points beyond them scaled as the measured ones are."""
        top = max(measured)
        # One factor for the prior's points beyond the measured counts: the median of measured / prior
        # over the measured counts (a rare count's noisy median alone would move it).
        scale = median(c / step_cost(self.prior, t) for t, c in measured.items())
        points = {1: 1.0, **measured, **{t: c * scale for t, c in self.prior.items() if t > top}}
        curve, highest = {}, 1.0
        for t in sorted(points):
            highest = max(highest, points[t])
            curve[t] = round(highest, 4)
        return curve
