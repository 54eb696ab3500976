"""What a draft is worth per unit of step cost: acceptance priors, the step-cost curve and tree choice.

A T-row base step costs ``step_cost(curve, T)`` plain steps (the curve is measured per machine at load;
:data:`CPU_COST_CURVE` is the prior), and a tree emits ``expected_tokens`` per step under an acceptance
model, so a tree (or chain length) is worth its expected tokens divided by its cost.

Only numpy is imported here: this module is part of the deployed runtime.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .errors import TreeSpecError
from .tree import TreeSpec
from .tree_table import STATIC_TREES

# P(rank-k candidate is the right token | its parent was right), the same at every depth: top-1 at
# 0.6 (so a top-1 chain survives d levels with 0.6**d), lower ranks sharing a decaying remainder.
DEFAULT_ACCEPT = np.array([0.6, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01, 0.01])

# Cost of a T-token base step relative to a 1-token step on this project's 2-core CI CPU; re-measure
# per machine with ``specdeploy bench`` and pass the result to choose_default_tree.
CPU_COST_CURVE = {1: 1.0, 8: 1.28, 16: 1.62, 32: 2.56, 64: 4.4}


def expected_tokens(spec: TreeSpec, accept: np.ndarray = DEFAULT_ACCEPT) -> float:
    """Expected tokens emitted per greedy step: 1 (bonus) + sum over nodes of P(node accepted).

    ``accept`` is [K] (same at every depth) or [D, K]: the probability that the rank-k candidate at
    depth d+1 is the base's token given its parent was. Siblings are exclusive under greedy
    verification, so a node is accepted with the product of its path's probabilities.
    """
    a = np.atleast_2d(np.asarray(accept, dtype=np.float64))
    total = 1.0
    for path in spec.choices:
        prob = 1.0
        for d, k in enumerate(path):
            row = a[min(d, a.shape[0] - 1)]
            prob *= row[k] if k < row.size else 0.0
        total += prob
    return total


def step_cost(cost_curve: Mapping[int, float], num_nodes: int) -> float:
    """Cost of a ``num_nodes``-token step: linear interpolation, linear extrapolation past the end."""
    ts = np.array(sorted(cost_curve), dtype=np.float64)
    cs = np.array([cost_curve[int(t)] for t in ts], dtype=np.float64)
    if num_nodes > ts[-1] and ts.size >= 2:
        slope = (cs[-1] - cs[-2]) / (ts[-1] - ts[-2])
        return float(cs[-1] + slope * (num_nodes - ts[-1]))
    return float(np.interp(num_nodes, ts, cs))


def choose_default_tree(
    cost_curve: Mapping[int, float] = CPU_COST_CURVE,
    expected_accept: np.ndarray = DEFAULT_ACCEPT,
    candidates: Mapping[str, TreeSpec] = STATIC_TREES,
) -> str:
    """Name of the candidate tree with the most expected tokens per unit of step cost."""
    if not candidates or not cost_curve:
        raise TreeSpecError("Choosing a tree needs at least one candidate tree and one measured step cost.")
    return max(
        candidates,
        key=lambda name: (
            expected_tokens(candidates[name], expected_accept)
            / step_cost(cost_curve, candidates[name].num_nodes)
        ),
    )
