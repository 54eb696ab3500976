"""The named static trees (``chain4``, ``tree8`` ... ``tree64``) and ``--tree``: a name, ``chainN``, a JSON list of
paths or ``dynamic[:N]``, checked against a bundle's limits."""

from __future__ import annotations

import json

from .errors import TreeSpecError
from .tree import TreeSpec

# Static trees. Grown greedily under tree_cost.DEFAULT_ACCEPT with depth <= 4: each is the set of
# paths with the largest expected accepted length for its size, so they are deep along top-1 and
# wide near the root, like Medusa's mc_sim_7b_63. Sizes count the root.
CHAIN4 = TreeSpec.static([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
TREE8 = TreeSpec.static([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)])
TREE16 = TreeSpec.static([
    (0,), (1,), (2,), (3,), (4,), (0, 0), (0, 1), (0, 2), (1, 0), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0),
])  # fmt: skip
TREE32 = TreeSpec.static([
    (0,), (1,), (2,), (3,), (4,), (5,), (6,),
    (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (2, 0), (3, 0), (4, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0), (0, 2, 0), (0, 3, 0), (1, 0, 0), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
])  # fmt: skip
TREE64 = TreeSpec.static([
    (0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,), (8,), (9,),
    (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7),
    (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (3, 0), (4, 0), (5, 0), (6, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 0, 5), (0, 1, 0), (0, 1, 1),
    (0, 2, 0), (0, 3, 0), (0, 4, 0), (0, 5, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0),
    (2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 3), (0, 0, 0, 4), (0, 0, 1, 0), (0, 0, 2, 0),
    (0, 0, 3, 0), (0, 0, 4, 0), (0, 1, 0, 0), (0, 2, 0, 0), (0, 3, 0, 0), (0, 4, 0, 0),
    (1, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0), (4, 0, 0, 0),
])  # fmt: skip

STATIC_TREES: dict[str, TreeSpec] = {
    "chain4": CHAIN4,
    "tree8": TREE8,
    "tree16": TREE16,
    "tree32": TREE32,
    "tree64": TREE64,
}

DYNAMIC_DEFAULT_NODES = 32  # node budget of ``--tree dynamic``


def tree_choice(s: str, max_tree: int, max_depth: int, dynamic: bool = True) -> tuple[TreeSpec | None, int | None]:
    """``--tree`` checked against a bundle's limits: ``(static spec, None)`` or, for ``dynamic[:N]`` (a
    tree grown by draft confidence, where the drafter supports it), ``(None, node budget)``."""
    s = s.strip()
    if s == "dynamic" or s.startswith("dynamic:"):
        if not dynamic:
            raise TreeSpecError(f"'{s}' needs a trained draft's scores; this drafter takes static trees only.")
        tail = s.split(":", 1)[1] if ":" in s else str(DYNAMIC_DEFAULT_NODES)
        nodes = int(tail) if tail.isdigit() else -1
        if not (2 <= nodes <= max_tree):
            raise TreeSpecError(f"A dynamic tree needs 2 to {max_tree} nodes, got '{tail}'.")
        return None, nodes
    return parse_tree_arg(s).validate(max_tree, max_depth), None


def parse_tree_arg(s: str) -> TreeSpec:
    """Parse ``--tree``: a registry name (``tree16``), ``chainN`` (N top-1 nodes after the root) or a JSON
    list of paths (``[[0],[1],[0,0]]``)."""
    s = s.strip()
    if s in STATIC_TREES:
        return STATIC_TREES[s]
    if s.startswith("chain") and s[5:].isdigit() and int(s[5:]) >= 1:
        return TreeSpec.static([(0,) * d for d in range(1, int(s[5:]) + 1)])
    try:
        value = json.loads(s)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(
        isinstance(p, list) and all(isinstance(k, int) and not isinstance(k, bool) for k in p) for p in value
    ):
        names = ", ".join(STATIC_TREES)
        raise TreeSpecError(
            f"Unknown tree '{s}': use one of {names}, chainN or a JSON list of paths like [[0],[1],[0,0]]."
        )
    return TreeSpec.static(value)
