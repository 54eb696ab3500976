"""How deep a model draft should go on this step: its own confidence, calibrated, against measured costs.

A trained draft's top-1 probabilities say how likely each drafted token is to be accepted, but not
truthfully: a small draft is over- or under-confident, differently at each depth. So for each depth d
and each band of the draft's top-1 probability, a Beta estimate of the chance that the depth-d token
is accepted, given that the tokens before it were, is learned from the verifier's verdicts on every
step that drafted (:class:`ConfidenceCalibration`). It starts from the draft's own probability and
keeps learning across generations.

With it, a chain's expected tokens are ``1 + q_1 + ... + q_L`` (``q_d`` the product of the calibrated
chances up to d), and its cost is the base step's cost for ``L + 1`` rows (the backend's measured cost
curve) plus the draft calls made, each timed here relative to a plain step (:class:`CallTimer`).
:class:`ChainPolicy` keeps the length with the most expected tokens per unit of cost: it stops a
sequential draft (Chimera, one call per depth) as soon as no deeper chain is expected to pay for its
calls, and shortens a chain whose tail is unlikely to be accepted. ``L = 0`` is a plain step.

Verification is untouched, so the output is the same whatever the policy decides: only the speed
depends on it. numpy only: this is part of the lean runtime.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from ..tree import DraftTree
from ..tree_cost import CPU_COST_CURVE, step_cost

_EMA = 0.1  # weight of a new timing in the running means
TYPICAL_ROWS = 8  # a call over more rows (a prompt, a long catch-up) is not a typical draft call


class ConfidenceCalibration:
    """Per depth and per band of draft probability, Beta counts of (accepted, rejected)."""

    def __init__(self, depth: int, bands: int = 10, prior: float = 2.0):
        if depth < 1 or bands < 1 or prior <= 0:
            raise ValueError("a confidence calibration needs depth >= 1, bands >= 1 and a positive prior")
        self.bands = bands
        centre = (np.arange(bands) + 0.5) / bands  # the prior: the draft's probability taken at its word
        self.prior = np.stack([prior * centre, prior * (1.0 - centre)], axis=-1)  # [bands, 2]
        self.seen = np.zeros((depth, bands, 2))  # verdicts: (accepted, rejected)

    @property
    def depth(self) -> int:
        return self.seen.shape[0]

    def band(self, prob: float) -> int:
        return min(max(int(prob * self.bands), 0), self.bands - 1)

    def chance(self, d: int, prob: float) -> float:
        """P(the depth-``d`` token (0-based) is accepted | the ones before were, its draft prob ``prob``)."""
        b = self.band(prob)
        a, r = self.seen[d, b] + self.prior[b]
        return float(a / (a + r))

    def typical(self, d: int) -> float:
        """P(the depth-``d`` token is accepted | the ones before were), before its probability is known.

        Optimistic while depth d has few verdicts (prior 2 accepted, 1 rejected), so that a depth the
        policy has not tried yet gets tried."""
        a, r = self.seen[d].sum(axis=0)
        return float((a + 2.0) / (a + r + 3.0))

    def chain(self, probs: Sequence[float]) -> np.ndarray:
        """``q_d``: the chance that the first d+1 drafted tokens are all accepted, for each d."""
        return np.cumprod([self.chance(d, p) for d, p in enumerate(probs[: self.depth])])

    def update(self, probs: Sequence[float], accepted: int) -> None:
        """``accepted`` of the drafted chain (its tokens' draft probabilities ``probs``) were accepted."""
        for d in range(min(accepted + 1, len(probs), self.depth)):
            self.seen[d, self.band(probs[d]), 0 if d < accepted else 1] += 1.0

    def observe(self, d: int, prob: float, right: bool) -> None:
        """One verdict on a depth-``d`` token whose predecessors were right."""
        self.seen[d, self.band(prob), 0 if right else 1] += 1.0


class CallTimer:
    """Running means of one draft call and of one step without its calls, on this machine.

    :meth:`start` when a step's drafting begins, :meth:`timed` for each draft call made, :meth:`stop`
    when the verifier's verdict is in; :attr:`call_cost` is a call relative to the rest of a step.
    A step that never stops (its proposal was not the one verified) is not timed.

    A call over more than :data:`TYPICAL_ROWS` rows (a draft with its own cache catching up on the states
    it missed) is not a typical call: it is timed apart, as its time beyond a typical call per row taken
    in, so that :meth:`catch_up_cost` can price the next catch-up before it is made; :attr:`calls` and
    :attr:`catch_ups` count them. The sequences of a batch share one draft model's timer (its call costs are
    the machine's): each then prices its first catch-up by what another's cost.
    """

    def __init__(self) -> None:
        self.call_s: float | None = None
        self.step_s: float | None = None
        self.row_s: float | None = None  # a catch-up's time beyond a typical call, per row it took in
        self._t0: float | None = None
        self.calls_s = 0.0  # calls made since start
        self.calls = 0  # calls timed, and those of them over more than TYPICAL_ROWS rows (catch-ups)
        self.catch_ups = 0

    def start(self) -> None:
        self._t0, self.calls_s = time.perf_counter(), 0.0

    def timed(self, seconds: float, rows: int = 1) -> None:
        self.calls_s += seconds
        self.calls += 1
        self.catch_ups += rows > TYPICAL_ROWS
        if rows <= TYPICAL_ROWS:  # the cost of a call on an ordinary step
            self.call_s = seconds if self.call_s is None else (1 - _EMA) * self.call_s + _EMA * seconds
        else:  # a catch-up: what it took beyond a typical call (all of it before one is timed), per row
            row = max(seconds - (self.call_s or 0.0), 0.0) / rows
            self.row_s = row if self.row_s is None else (1 - _EMA) * self.row_s + _EMA * row

    def stop(self) -> None:
        if self._t0 is None:
            return
        step = time.perf_counter() - self._t0 - self.calls_s
        self.step_s = step if self.step_s is None else (1 - _EMA) * self.step_s + _EMA * step
        self._t0 = None

    @property
    def call_cost(self) -> float:
        return self.call_s / self.step_s if self.call_s and self.step_s else 0.0

    def catch_up_cost(self, rows: int) -> float:
        """What a call over ``rows`` rows costs beyond a typical call, relative to the rest of a step: 0 for a
        typical call, and until a catch-up and a step have been timed."""
        if rows <= TYPICAL_ROWS or self.row_s is None or not self.step_s:
            return 0.0
        return rows * self.row_s / self.step_s

    def profile(self) -> dict:
        """``draft_call_ms`` and ``step_ms`` (a step without its draft calls), once measured."""
        out = {}
        if self.call_s is not None:
            out["draft_call_ms"] = round(1e3 * self.call_s, 3)
        if self.step_s is not None:
            out["step_ms"] = round(1e3 * self.step_s, 3)
        if self.row_s is not None:
            out["catch_up_ms_per_row"] = round(1e3 * self.row_s, 4)
        return out


class ChainPolicy:
    """The length of a model draft's chain with the most expected tokens per unit of cost."""

    def __init__(self, depth: int, cost_curve: Mapping[int, float] = CPU_COST_CURVE):
        self.calibration = ConfidenceCalibration(depth)
        self.timer = CallTimer()
        self._probs: list[float] = []  # draft probabilities of the last chain proposed
        # The first drafted token past the verified chain, (depth, prob, id, where), where being the index
        # its token takes in the context: when the whole chain is accepted, the next root, which the base
        # chose there, says whether it was right. Until then it is pending.
        self._beyond: tuple[int, float, int, int] | None = None
        self._pending: tuple[int, float, int, int] | None = None
        self.use_cost_curve(cost_curve)

    def use_cost_curve(self, cost_curve: Mapping[int, float]) -> None:
        self._curve = dict(cost_curve)
        self._cost = np.array([step_cost(cost_curve, n) for n in range(1, self.calibration.depth + 2)])

    def step_cost(self, rows: int) -> float:
        """A step of ``rows`` rows relative to a plain step, on the cost curve in use."""
        return step_cost(self._curve, rows)

    def best(self, q: np.ndarray, calls: int) -> tuple[int, float]:
        """(length, expected tokens per unit of cost) of the best prefix of a chain with chances ``q``."""
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(q)])
        value = expected / (self._cost[: len(expected)] + calls * self.timer.call_cost)
        best = int(np.argmax(value))
        return best, float(value[best])

    def length(self, probs: Sequence[float], calls: int) -> int:
        """How many of the drafted tokens (draft probabilities ``probs``, after ``calls`` calls) to verify."""
        return self.best(self.calibration.chain(probs), calls)[0]

    def another_call(self, probs: Sequence[float], calls: int) -> bool:
        """Whether drafting deeper (one call per depth) is expected to beat stopping at ``probs``."""
        d = len(probs)
        if d >= self.calibration.depth:
            return False
        q = self.calibration.chain(probs)
        now = self.best(q, calls)[1]
        reach = q[-1] if d else 1.0
        more = [reach := reach * self.calibration.typical(j) for j in range(d, self.calibration.depth)]
        deeper = np.concatenate([q, more])
        return any(self.best(deeper[: d + j], calls + j)[1] > now for j in range(1, len(more) + 1))

    def chain(self, tokens: np.ndarray, ids: np.ndarray, probs: np.ndarray, calls: int,
              max_nodes: int) -> DraftTree:
        """The chain ``tokens[-1], ids[0], ..`` cut to the length worth verifying (``probs``: the ids' draft
        probabilities); its probabilities are kept for :meth:`verdict`."""
        n = min(self.length(probs, calls), max_nodes - 1)
        self._probs = [float(p) for p in probs[:n]]
        self._beyond = (n, float(probs[n]), int(ids[n]), len(tokens) + n) if n < len(probs) else None
        return DraftTree(np.concatenate([[tokens[-1]], ids[:n]]), np.arange(-1, n))

    def verdict(self, accepted: int) -> None:
        """``accepted`` tokens of the last :meth:`chain` were accepted: time the step, learn from it."""
        self.timer.stop()
        if self._probs:
            self.calibration.update(self._probs, accepted)
        self._pending = self._beyond if accepted == len(self._probs) else None
        self._probs, self._beyond = [], None

    def observe(self, tokens: np.ndarray) -> tuple[int, bool] | None:
        """Settle the pending token past the last verified chain from the context that followed that step
        (its root is the base's choice there); returns (its depth, whether it was right), or None."""
        pending, self._pending = self._pending, None
        if pending is None or len(tokens) != pending[3] + 1:  # not the step right after it
            return None
        d, prob, token, where = pending
        right = int(tokens[where]) == token
        self.calibration.observe(d, prob, right)
        return d, right


class CostAwareGate:
    """Before a step: draft + verify, or a plain step, whichever is expected to give more tokens per cost.

    The gate's signal (a score in [0, 1]: the learned gate's P(accepted >= 1), or ``1 / (1 + entropy)``
    of the distribution that produced the root) goes through its own calibration, per
    band, to the chance that the first drafted token is accepted; deeper tokens take the chain policy's
    typical chances. Drafting pays when the best chain's expected tokens per unit of cost (rows from the
    measured cost curve, plus the draft call) beat a plain step's 1. It learns from the verdict of every
    step it drafts; a band it keeps turning down is still drafted once in ``explore_every`` of its steps,
    so that a band which has become worth drafting is noticed.
    """

    def __init__(self, policy: ChainPolicy, bands: int = 10, explore_every: int = 16):
        self.policy = policy
        self.calibration = ConfidenceCalibration(1, bands)
        self.explore_every = explore_every
        self._skipped = np.zeros(bands, dtype=np.int64)
        self._signal: float | None = None  # the signal of the step drafted last, until its verdict
        self.decisions = {"draft": 0, "explore": 0, "plain": 0}

    def drafts(self, signal: float, rows: int | None = None) -> bool:
        """Whether this step drafts. ``rows``: the nodes of the tree it would verify (None: a chain,
        cut to its best length)."""
        policy, depth = self.policy, self.policy.calibration.depth
        q = [self.calibration.chance(0, signal)]
        for d in range(1, depth):
            q.append(q[-1] * policy.calibration.typical(d))
        if rows is None:
            value = policy.best(np.asarray(q), 1)[1]
        else:
            value = (1.0 + sum(q)) / (policy.step_cost(rows) + policy.timer.call_cost)
        band = self.calibration.band(signal)
        if value > 1.0:
            verdict = "draft"
        elif self._skipped[band] + 1 >= self.explore_every:
            verdict = "explore"
        else:
            self._skipped[band] += 1
            self.decisions["plain"] += 1
            self._signal = None
            return False
        self._skipped[band] = 0
        self.decisions[verdict] += 1
        self._signal = signal
        return True

    def verdict(self, accepted: int, drafted: int) -> None:
        """``accepted`` of the ``drafted`` tokens of the step this gate let draft were accepted. A step
        that drafted but verified nothing waits for :meth:`settle`."""
        if self._signal is not None and drafted > 0:
            self.calibration.update([self._signal], accepted)
            self._signal = None

    def settle(self, observed: tuple[int, bool] | None) -> None:
        """The verdict on the first drafted token of a step that verified none (``ChainPolicy.observe``)."""
        if self._signal is not None and observed is not None and observed[0] == 0:
            self.calibration.observe(0, self._signal, observed[1])
        self._signal = None
