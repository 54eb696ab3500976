"""Draft trees as data: static Medusa-style specs, dynamic EAGLE-2-style selection, and buffers.

A tree step feeds N nodes to the base model at once. Node 0 is always the root: the last committed
token, whose K/V is not in the cache yet. Every other node is a drafted token whose parent is an
earlier node (``parents[i] < i``), so any array indexed by node is in topological order.

- :class:`TreeSpec` is a static shape: Medusa "choices", each a path of top-k ranks per depth.
- :class:`DraftTree` is one step's concrete tree: node tokens and parents (plus optional scores).
- :class:`TreeBuffers` is what the base step and the verifier need, built once per parent structure
  and cached, so a static tree costs nothing per step.

The named static trees and ``--tree`` parsing are ``tree_table.py``; what a tree is worth per unit
of step cost is ``tree_cost.py``.

Only numpy is imported here: this module is part of the deployed runtime.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import TreeSpecError

Path = tuple[int, ...]


@dataclass(frozen=True)
class TreeSpec:
    """A static tree: Medusa-style choices, each a path of top-k ranks, one rank per depth.

    ``(0, 1)`` is "the 2nd candidate at depth 2 under the 1st candidate at depth 1". The root is
    implicit, so the tree has ``1 + len(choices)`` nodes. Choices are kept sorted by (length, values),
    which is Medusa's node order and puts every parent before its children.
    """

    choices: tuple[Path, ...]

    def __post_init__(self) -> None:
        paths = tuple(sorted((tuple(int(k) for k in c) for c in self.choices), key=lambda c: (len(c), c)))
        seen: set[Path] = set()
        for path in paths:
            if not path or min(path) < 0:
                raise TreeSpecError(f"Tree path {list(path)} must be a non-empty list of ranks >= 0.")
            if path in seen:
                raise TreeSpecError(f"Tree path {list(path)} appears more than once.")
            if len(path) > 1 and path[:-1] not in seen:
                raise TreeSpecError(f"Dangling path {list(path)}: its prefix {list(path[:-1])} is missing.")
            seen.add(path)
        object.__setattr__(self, "choices", paths)

    @classmethod
    def static(cls, choices) -> TreeSpec:
        """Build (and structurally validate) a static tree from any iterable of paths."""
        return cls(tuple(tuple(c) for c in choices))

    @property
    def num_nodes(self) -> int:
        return 1 + len(self.choices)

    @property
    def depth(self) -> int:
        """Deepest drafted level (0 for a root-only tree); a drafter needs this many heads."""
        return max((len(c) for c in self.choices), default=0)

    @property
    def is_chain(self) -> bool:
        """True for ``chainN``: each depth's top-1 candidate under the one before, and nothing else."""
        return all(not any(path) for path in self.choices) and len(self.choices) == self.depth

    @property
    def topk(self) -> int:
        """Candidates needed per depth: one more than the largest rank used."""
        return 1 + max((max(c) for c in self.choices), default=-1)

    @property
    def parents(self) -> np.ndarray:
        """[N] int64 parent node index of each node, -1 for the root (read-only, cached)."""
        return spec_arrays(self)[0]

    def validate(self, max_tree: int, max_depth: int) -> TreeSpec:
        """Check the tree fits a bundle (``max_tree`` nodes with root) and a drafter (``max_depth`` heads)."""
        if self.num_nodes > max_tree:
            raise TreeSpecError(
                f"The tree has {self.num_nodes} nodes but this bundle allows at most {max_tree}."
            )
        if self.depth > max_depth:
            raise TreeSpecError(
                f"The tree is {self.depth} deep but the drafter proposes at most {max_depth}."
            )
        return self

    def buffers(self) -> TreeBuffers:
        return build_buffers(self.parents)


_ROOT_PARENTS = np.array([-1], dtype=np.int64)
_ROOT_PARENTS.setflags(write=False)


@lru_cache(maxsize=128)
def _chain_parents(n: int) -> np.ndarray:
    """The parents of an ``n``-node chain, -1 then 0..n-2 (read-only, one array per length)."""
    if n == 1:
        return _ROOT_PARENTS
    parents = np.arange(-1, n - 1, dtype=np.int64)
    parents.setflags(write=False)
    return parents


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One step's draft: node tokens in topological order, node 0 being the root token."""

    tokens: np.ndarray  # [N] int64, tokens[0] = last committed token
    parents: np.ndarray  # [N] int64, parents[0] = -1, 0 <= parents[i] < i
    scores: np.ndarray | None = None  # [N] float64 cumulative draft log-prob, root 0.0
    # What its drafter priced this proposal at: expected tokens per unit of step cost (a plain step's is 1.0);
    # None where the drafter does not price its proposals (a trained draft's raw proposal)
    value: float | None = None
    # Each node's chance of being accepted as its drafter priced it ([N], the root's 1.0): the suffix drafter's
    # calibrated path shares. A batch's rows rule weighs such a draft by them; None: by the source's earned record.
    chances: np.ndarray | None = None

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        if tokens.shape != parents.shape or tokens.size == 0:
            raise TreeSpecError(
                f"A draft tree needs one parent per token, got {tokens.size} and {parents.size}."
            )
        _check_parents(parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        if self.scores is not None:
            scores = np.asarray(self.scores, dtype=np.float64).reshape(-1)
            if scores.shape != tokens.shape:
                raise TreeSpecError(
                    f"A draft tree needs one score per token, got {scores.size} for {tokens.size}."
                )
            object.__setattr__(self, "scores", scores)

    @classmethod
    def root(cls, token: int) -> DraftTree:
        """The 1-node tree of a plain step, made without the general checks (once per decoded token)."""
        tree = object.__new__(cls)
        object.__setattr__(tree, "tokens", np.array([token], dtype=np.int64))
        object.__setattr__(tree, "parents", _ROOT_PARENTS)
        object.__setattr__(tree, "scores", None)
        object.__setattr__(tree, "value", None)
        object.__setattr__(tree, "chances", None)
        return tree

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        """The chain ``tokens[0] -> tokens[1] -> ...`` (root first), made without the general checks: a chain's
        parents are valid by construction (once per drafted step; see :func:`verify._chain_accept` for why
        small numpy calls are avoided there)."""
        if not tokens:
            raise TreeSpecError("A draft tree needs at least its root node.")
        tree = object.__new__(cls)
        object.__setattr__(tree, "tokens", np.array(tokens, dtype=np.int64))
        object.__setattr__(tree, "parents", _chain_parents(len(tokens)))
        object.__setattr__(tree, "scores", None)
        object.__setattr__(tree, "value", None)
        object.__setattr__(tree, "chances", None)
        return tree

    def priced(self, value: float) -> DraftTree:
        """This proposal with the value its drafter priced it at (the same arrays, no checks again)."""
        tree = object.__new__(type(self))
        for name in ("tokens", "parents", "scores", "chances"):
            object.__setattr__(tree, name, getattr(self, name))
        object.__setattr__(tree, "value", float(value))
        return tree

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def buffers(self) -> TreeBuffers:
        return build_buffers(self.parents)

    @property
    def is_chain(self) -> bool:
        return self.parents is _chain_parents(self.num_nodes) or bool(
            np.array_equal(self.parents, np.arange(-1, self.num_nodes - 1)))

    def main_nodes(self) -> np.ndarray:
        """The node indices of :meth:`main_path`, root first."""
        if self.is_chain:
            return np.arange(self.num_nodes)
        path = [0]
        first_child: dict[int, int] = {}
        for i in range(self.num_nodes - 1, 0, -1):  # the smallest index wins
            first_child[int(self.parents[i])] = i
        while path[-1] in first_child:
            path.append(first_child[path[-1]])
        return np.asarray(path)

    def main_path(self) -> DraftTree:
        """The chain from the root through each node's first child (the drafter's best candidate).

        Drafters list a node's children best first, so this is the top-ranked path of the tree.
        """
        if self.is_chain:
            return self
        idx = self.main_nodes()
        scores = None if self.scores is None else self.scores[idx]
        chances = None if self.chances is None else self.chances[idx]
        return DraftTree(self.tokens[idx], np.arange(-1, idx.size - 1, dtype=np.int64), scores, chances=chances)

    @classmethod
    def from_static(cls, spec: TreeSpec, root_token: int, topk: np.ndarray) -> DraftTree:
        """Fill a static tree from per-depth candidates.

        ``topk``: [D, K] token ids, ``topk[d, k]`` being the k-th candidate at depth d+1 (Medusa heads
        give one top-k list per depth). Node with path ``(k1, .., kd)`` gets ``topk[d-1, kd]``.
        """
        topk = np.asarray(topk, dtype=np.int64)
        if topk.ndim != 2 or topk.shape[0] < spec.depth or topk.shape[1] < spec.topk:
            raise TreeSpecError(
                f"The tree needs top-{spec.topk} candidates at {spec.depth} depths, got shape {topk.shape}."
            )
        parents, depth, rank = spec_arrays(spec)
        tokens = np.empty(spec.num_nodes, dtype=np.int64)
        tokens[0] = root_token
        tokens[1:] = topk[depth - 1, rank]
        return cls(tokens, parents)


@lru_cache(maxsize=64)
def spec_arrays(spec: TreeSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([N] parents, [N-1] depth, [N-1] last rank) of a static tree, built once per spec."""
    index = {c: i + 1 for i, c in enumerate(spec.choices)}  # the root's path () is node 0
    parents = np.array([-1] + [index.get(c[:-1], 0) for c in spec.choices], dtype=np.int64)
    depth = np.array([len(c) for c in spec.choices], dtype=np.int64)
    rank = np.array([c[-1] for c in spec.choices], dtype=np.int64)
    for a in (parents, depth, rank):
        a.setflags(write=False)
    return parents, depth, rank


def _check_parents(parents: np.ndarray) -> None:
    if parents[0] != -1 or np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, parents.size)):
        raise TreeSpecError("Tree parents must be -1 for the root and an earlier node for every other node.")


def select_dynamic(
    candidate_parents, candidate_tokens, candidate_scores, budget: int, *, root_token: int
) -> DraftTree:
    """Keep the ``budget`` best candidates (plus the root) as an ancestor-closed tree, EAGLE-2 style.

    Candidates form a forest under the root: ``candidate_parents[i]`` is -1 (child of the root) or an
    earlier candidate. Scores are cumulative log-probs, so a child never outscores its parent; then
    the top ``budget`` by (score, index) are already closed under ancestors and in topological order.
    If a drafter breaks that rule, a best-first expansion from the root still returns a closed,
    topologically ordered set of the same size.
    Nodes come out ordered by score, which is topological and tries the likelier siblings first.
    """
    parents = np.asarray(candidate_parents, dtype=np.int64).reshape(-1)  # [M]
    tokens = np.asarray(candidate_tokens, dtype=np.int64).reshape(-1)  # [M]
    scores = np.asarray(candidate_scores, dtype=np.float64).reshape(-1)  # [M]
    m = parents.size
    if tokens.size != m or scores.size != m:
        raise TreeSpecError(
            f"Candidates need matching parents, tokens and scores, got {m}, {tokens.size}, {scores.size}."
        )
    if np.any(parents < -1) or np.any(parents >= np.arange(m)):
        raise TreeSpecError("Candidate parents must be -1 (the root) or an earlier candidate.")
    budget = max(0, min(int(budget), m))

    order = np.lexsort((np.arange(m), -scores))[:budget]  # [budget] best first, ties by index
    position = np.full(m + 1, m + 1, dtype=np.int64)  # unkept candidates sort after everything
    position[m] = -1  # slot m stands for the root (parent -1)
    position[order] = np.arange(order.size)
    if not np.all(position[parents[order]] < np.arange(order.size)):  # not closed or not topological
        order = _best_first(parents, scores, budget)

    new_index = np.full(m + 1, 0, dtype=np.int64)  # root maps to node 0
    new_index[order] = np.arange(1, order.size + 1)
    return DraftTree(
        tokens=np.concatenate([[root_token], tokens[order]]),
        parents=np.concatenate([[-1], new_index[parents[order]]]),
        scores=np.concatenate([[0.0], scores[order]]),
    )


def _best_first(parents: np.ndarray, scores: np.ndarray, budget: int) -> np.ndarray:
    """Grow from the root, always taking the best frontier candidate (closed by construction)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents.tolist()):
        children.setdefault(p, []).append(i)
    frontier = [(-scores[i], i) for i in children.get(-1, [])]
    heapq.heapify(frontier)
    out: list[int] = []
    while frontier and len(out) < budget:
        _, i = heapq.heappop(frontier)
        out.append(i)
        for c in children.get(i, []):
            heapq.heappush(frontier, (-scores[c], c))
    return np.array(out, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Everything a tree step needs that depends only on the parent structure (arrays are read-only)."""

    parents: np.ndarray  # [N] int64, -1 for the root
    depth: np.ndarray  # [N] int64, root 0; position id = past length + depth
    mask: np.ndarray  # [N, N] bool, mask[i, j]: node i attends to node j (j is i or an ancestor)
    retrieve: np.ndarray  # [L, D+1] int64, root-to-leaf node paths padded with -1, one row per leaf
    internal: np.ndarray  # [I] int64, nodes that have children (the verifier needs only their rows)
    children: tuple[tuple[int, ...], ...]  # children[i]: child node indices of node i, in order
    chain: bool = False  # every node's parent is the node before it (node i sits at depth i)

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])


def build_buffers(parents) -> TreeBuffers:
    """Build (or fetch from cache) the buffers for a parent array ``[N]`` with ``parents[i] < i``."""
    if isinstance(parents, np.ndarray) and parents is _chain_parents(parents.shape[0]):  # no numpy call
        return _build_buffers(tuple(range(-1, parents.shape[0] - 1)))
    return _build_buffers(tuple(np.asarray(parents, dtype=np.int64).reshape(-1).tolist()))


@lru_cache(maxsize=256)
def _build_buffers(key: tuple[int, ...]) -> TreeBuffers:
    parents = np.array(key, dtype=np.int64)
    if parents.size == 0:
        raise TreeSpecError("A tree needs at least its root node.")
    _check_parents(parents)
    n = parents.size
    depth = np.zeros(n, dtype=np.int64)
    mask = np.eye(n, dtype=bool)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):  # parents come first, so their rows are complete already
        p = key[i]
        depth[i] = depth[p] + 1
        mask[i] |= mask[p]
        children[p].append(i)
    leaves = [i for i in range(n) if not children[i]]
    retrieve = np.full((len(leaves), int(depth.max()) + 1), -1, dtype=np.int64)
    for row, leaf in enumerate(leaves):
        # ancestors have smaller indices than their descendants, so sorted order is root-first
        path = np.flatnonzero(mask[leaf])
        retrieve[row, : path.size] = path
    internal = np.array([i for i in range(n) if children[i]], dtype=np.int64)
    arrays = (parents, depth, mask, retrieve, internal)
    for a in arrays:
        a.setflags(write=False)  # shared by every step that reuses this tree
    return TreeBuffers(*arrays, children=tuple(tuple(c) for c in children),
                       chain=all(p == i - 1 for i, p in enumerate(key)))

__all__ = [
    "DraftTree",
    "TreeBuffers",
    "TreeSpec",
    "build_buffers",
    "select_dynamic",
    "spec_arrays",
]
