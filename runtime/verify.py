"""Verification: which drafted nodes the base model accepts, and the bonus token after them.

Every rule takes the step's :class:`~.tree.DraftTree`, its :class:`~.tree.TreeBuffers` and the base
logits ``[T, V]`` of the tree step (``T >= N``; rows past the tree's N nodes are padding and ignored).
``logits[i]`` is the base model's prediction for the token *after* node i.

- :func:`greedy_accept`: output identical to plain greedy decoding.
- :func:`sample_accept`: tree rejection sampling (SpecInfer multi-draft); output distribution identical
  to plain sampling with the same :func:`warp_logits` settings.
- :func:`seeded_accept`: sampling with a seed: the token at each position is drawn with that position's
  own uniform (:func:`position_rng`), so the output equals plain seeded sampling token for token,
  whatever was drafted, and each token is an exact sample.
- :func:`typical_accept`: Medusa's typical acceptance. LOSSY, opt-in.

Only numpy is imported here: this module is part of the deployed runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import SpecDeployError, TreeSpecError
from .tree import DraftTree, TreeBuffers


@dataclass(frozen=True, eq=False)
class Acceptance:
    """Result of verifying one tree step."""

    nodes: np.ndarray  # [A] int64 accepted node indices on one root path, nodes[0] == 0 (the root)
    tokens: np.ndarray  # [A] int64 emitted: tokens of nodes[1:], then the bonus token

    @property
    def num_accepted_drafts(self) -> int:
        """Drafted tokens accepted this step (τ - 1)."""
        return int(self.nodes.shape[0]) - 1


# ---------------------------------------------------------------------------------------------------
# Distributions shared by speculative and plain sampling


def warp_logits(
    logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    """Base logits ``[..., V]`` -> float64 sampling probabilities ``[..., V]``.

    Order as in transformers: temperature, then top-k, then top-p on the renormalised result. Ties at
    a top-k or top-p cut are all kept, so the result does not depend on sort order. ``temperature``
    0 gives a one-hot argmax (greedy). Plain decoding must sample from this same function, so that
    speculative sampling reproduces its distribution exactly.
    """
    if not temperature >= 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise SpecDeployError(
            f"Sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got {temperature}, {top_k}, {top_p}."
        )
    z = np.array(logits, dtype=np.float64)  # [..., V] own copy, worked on in place below
    v = z.shape[-1]
    if temperature == 0:
        probs = np.zeros_like(z)
        np.put_along_axis(probs, z.argmax(-1)[..., None], 1.0, axis=-1)
        return probs
    if 0 < top_k < v:
        if np.isneginf(z).any():  # a grammar's mask: partition is ~15x slower over a row of mostly -inf
            for row in z.reshape(-1, v):  # views into z; the k-th largest of the finite values is the row's
                live = row[row > -np.inf]
                if live.size > top_k:
                    row[row < np.partition(live, live.size - top_k)[live.size - top_k]] = -np.inf
        else:
            kth = np.partition(z, v - top_k, axis=-1)[..., v - top_k, None]  # k-th largest (T > 0 keeps order)
            z[z < kth] = -np.inf
    # (z - max) / T == z / T - max / T; the max becomes exp(0) = 1, so no overflow and the sum is >= 1
    z -= z.max(-1, keepdims=True)
    z *= 1.0 / temperature
    probs = np.exp(z, out=z)
    probs /= probs.sum(-1, keepdims=True)
    if top_p < 1.0:
        for row in probs.reshape(-1, v):  # views into probs
            row[row < _nucleus_threshold(row, top_p)] = 0.0
            row /= row.sum()
    return probs


def _nucleus_threshold(p: np.ndarray, top_p: float) -> float:
    """Smallest probability kept by top-p: the fewest top tokens whose mass reaches ``top_p``.

    The nucleus is usually tiny, so look at the top 64, 256, ... tokens (argpartition, O(V))
    before falling back to a full sort.
    """
    v = p.shape[0]
    m = min(64, v)
    while True:
        top = np.sort(p[np.argpartition(p, v - m)[v - m :]])[::-1]  # [m] descending
        mass = np.cumsum(top)
        if mass[-1] >= top_p or m == v:
            return float(top[min(int(np.searchsorted(mass, top_p)), m - 1)])
        m = min(4 * m, v)


_BLOCK = 256


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from ``probs`` [V] (need not be normalised) by inverse CDF; zero entries are never drawn.

    Two-level search (block sums, then one block) because np.cumsum over a 50k vocabulary is slow.
    """
    v = probs.shape[0]
    blocks = -(-v // _BLOCK)
    padded = np.zeros(blocks * _BLOCK)
    padded[:v] = probs
    block_cdf = np.cumsum(padded.reshape(blocks, _BLOCK).sum(1))  # [blocks]
    u = rng.random() * block_cdf[-1]
    # side="right" gives the first block whose cdf exceeds u, so that block has positive mass
    b = min(int(np.searchsorted(block_cdf, u, side="right")), blocks - 1)
    block = padded[b * _BLOCK : (b + 1) * _BLOCK]
    if b > 0:
        u -= block_cdf[b - 1]
    i = int(np.searchsorted(np.cumsum(block), u, side="right"))
    last = int(np.flatnonzero(block)[-1])  # rounding can push u past the block's end: clamp to mass
    return b * _BLOCK + min(i, last)


# ---------------------------------------------------------------------------------------------------
# Acceptance rules


_ROOT_ONLY = np.zeros(1, dtype=np.int64)
_ROOT_ONLY.setflags(write=False)


def _check(tree: DraftTree, buffers: TreeBuffers, logits: np.ndarray) -> None:
    n = tree.num_nodes
    if buffers.num_nodes != n or logits.ndim != 2 or logits.shape[0] < n:
        raise TreeSpecError(
            f"Verification needs buffers for {n} nodes and logits [>= {n}, V], "
            f"got {buffers.num_nodes} nodes and logits {tuple(logits.shape)}."
        )
    if n > 1 and buffers.parents is not tree.parents and not np.array_equal(buffers.parents, tree.parents):
        raise TreeSpecError("The tree buffers were built for a different tree shape than the draft.")


def _longest_path(ok: np.ndarray, buffers: TreeBuffers) -> np.ndarray:
    """Accepted nodes of the longest root path whose nodes are all ``ok``.

    ``ok``: [N+1] bool, ok[0] = True (root) and ok[N] = False, which the -1 padding of ``retrieve``
    indexes, so padding ends every path.
    """
    path_ok = ok[buffers.retrieve]  # [L, D+1]
    lengths = np.logical_and.accumulate(path_ok, axis=1).sum(1)  # [L] all-true prefix length
    best = int(lengths.argmax())  # first longest; any longest path emits the same count
    return buffers.retrieve[best, : lengths[best]]


@lru_cache(maxsize=128)
def _prefix(k: int) -> np.ndarray:
    """Nodes 0..k-1, read-only: the accepted nodes of a chain whose first k-1 drafts were accepted."""
    nodes = np.arange(k, dtype=np.int64)
    nodes.setflags(write=False)
    return nodes


def _chain_accept(tree: DraftTree, logits: np.ndarray, row_argmax: np.ndarray | None) -> Acceptance:
    """:func:`greedy_accept` of a chain, in plain Python over its few tokens: row i's argmax is the token
    that must follow node i, so the rows are read in order up to the first rejected draft only. (After a
    step, the interpreter's and numpy's state is out of the caches the step streamed its weights
    through, and every small numpy call costs several microseconds: the general tree code took
    ~0.2 ms per chain step here.)"""
    tokens = tree.tokens.tolist()
    n = len(tokens)
    known = None if row_argmax is None else row_argmax[:n].tolist()
    a = 0  # drafts accepted so far
    while True:
        best = known[a] if known is not None else int(logits[a].argmax())
        if a + 1 == n or tokens[a + 1] != best:
            break
        a += 1
    return Acceptance(_prefix(a + 1), np.array(tokens[1 : a + 1] + [best], dtype=np.int64))


def greedy_accept(tree: DraftTree, buffers: TreeBuffers, logits: np.ndarray,
                  row_argmax: np.ndarray | None = None) -> Acceptance:
    """Accept the longest root path whose every token is the base argmax at its parent.

    The bonus is the argmax at the last accepted node, so the output equals plain greedy decoding.
    Argmax is taken only over rows that are a parent (plus one row for a leaf bonus): on tree64
    that is 27 of 64 rows of V. ``row_argmax`` ``[>= N]``: every row's argmax (first maximum) computed
    by the backend beside the logits; then no logits row is read.
    """
    _check(tree, buffers, logits)
    n = tree.num_nodes
    if row_argmax is not None:
        argmax = np.asarray(row_argmax[:n], dtype=np.int64)
        if n == 1:
            return Acceptance(_ROOT_ONLY, argmax[:1].copy())
    elif n == 1:  # a plain step: its argmax is the token (the per-step path of plain decoding)
        return Acceptance(_ROOT_ONLY, np.array([logits[0].argmax()], dtype=np.int64))
    if buffers.chain:
        return _chain_accept(tree, logits, row_argmax)
    if row_argmax is None:
        argmax = np.full(n, -1, dtype=np.int64)  # [N], -1 where not computed
        for i in buffers.internal.tolist():  # per row: no copy of [I, V], and 1-D argmax is the fast one
            argmax[i] = logits[i].argmax()
    ok = np.ones(n + 1, dtype=bool)
    ok[n] = False
    ok[1:n] = tree.tokens[1:] == argmax[buffers.parents[1:]]
    nodes = _longest_path(ok, buffers)
    last = int(nodes[-1])
    bonus = argmax[last] if argmax[last] >= 0 else logits[last].argmax()
    return Acceptance(nodes, np.append(tree.tokens[nodes[1:]], bonus).astype(np.int64))


def _row(logits, i: int, top_k: int) -> np.ndarray:
    """Row ``i`` of the logits. From a backend's device array (``top_row``, the torch backend's), only its
    top-k come back when top-k sampling is all :func:`warp_logits` keeps of the row: the rest is -inf there
    anyway, so the warped distribution is the same, bit for bit."""
    if top_k > 0 and hasattr(logits, "top_row"):
        return logits.top_row(i, top_k)
    return logits[i]


def sample_accept(
    tree: DraftTree,
    buffers: TreeBuffers,
    logits: np.ndarray,
    rng: np.random.Generator,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    draft_probs: np.ndarray | None = None,
) -> Acceptance:
    """Tree rejection sampling (SpecInfer multi-draft): lossless, output ~ warped base distribution.

    Walk from the root. At node u, p = warp(logits[u]); try u's children in order. A child with
    token x drawn from proposal q is accepted with probability min(1, p(x)/q(x)); on rejection
    p <- norm(max(p - q, 0)) and the next sibling is tried. An accepted child becomes u; if every
    child is rejected (or u is a leaf) the bonus token is drawn from the current p and the step ends.

    ``draft_probs``: [N, V] the proposal q each node's token was drawn from (siblings drawn
    independently). None means deterministic drafts (top-k heads, prompt lookup): q is a point mass,
    so the rule becomes "accept x with probability p(x), else zero p(x) and renormalise".
    """
    _check(tree, buffers, logits)
    tokens = tree.tokens.tolist()
    node = 0
    nodes, out = [0], []
    while True:
        p = warp_logits(_row(logits, node, top_k), temperature, top_k, top_p)  # [V] float64, our own copy
        mass = 1.0  # p's total: point-mass rejections zero entries instead of renormalising all of V
        child = -1
        for c in buffers.children[node]:
            x = tokens[c]
            if draft_probs is None:
                if rng.random() * mass < p[x]:  # u < p(x) / mass
                    child = c
                    break
                if p[x] < mass:  # p(x) == mass would be a sure accept, so this keeps mass > 0
                    mass -= p[x]
                    p[x] = 0.0
            else:
                q = np.asarray(draft_probs[c], dtype=np.float64)
                q = q / q.sum()
                p /= mass
                mass = 1.0
                if rng.random() * q[x] < p[x]:  # u < p(x)/q(x), without dividing by q(x) = 0
                    child = c
                    break
                residual = np.maximum(p - q, 0.0)
                total = residual.sum()
                if total > 0:  # total == 0 needs p == q, where rejection has probability 0
                    p, mass = residual, total
        if child < 0:
            out.append(sample_from(p, rng))  # sample_from needs no normalisation
            break
        nodes.append(child)
        out.append(tokens[child])
        node = child
    return Acceptance(np.array(nodes, dtype=np.int64), np.array(out, dtype=np.int64))


def position_rng(seed: int, position: int) -> np.random.Generator:
    """The random stream of the token at ``position`` (its index in prompt + output) of a seeded request."""
    return np.random.default_rng([seed, position])


def seeded_accept(
    tree: DraftTree,
    buffers: TreeBuffers,
    logits: np.ndarray,
    seed: int,
    position: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> Acceptance:
    """Seeded sampling, reproducible whatever was drafted: ``position`` is the index of the token after
    the root. At node u (depth d), the token y = F_u^-1(U(seed, position + d)) is what plain seeded
    sampling draws there (inverse CDF of the warped distribution, one uniform per position); the child
    whose token is y is accepted and the walk goes on, else y is the bonus and the step ends. Each token
    is an exact sample (the uniforms are independent across positions), and a drafted token is accepted
    with probability p(x), as point-mass rejection sampling does.
    """
    _check(tree, buffers, logits)
    tokens = tree.tokens.tolist()
    node, depth = 0, 0
    nodes, out = [0], []
    while True:
        p = warp_logits(_row(logits, node, top_k), temperature, top_k, top_p)
        y = sample_from(p, position_rng(seed, position + depth))
        out.append(y)
        child = next((c for c in buffers.children[node] if tokens[c] == y), -1)
        if child < 0:
            break
        nodes.append(child)
        node, depth = child, depth + 1
    return Acceptance(np.array(nodes, dtype=np.int64), np.array(out, dtype=np.int64))


@dataclass(frozen=True)
class TypicalRule:
    """Medusa's typical-acceptance knobs (its ``posterior_threshold`` and ``posterior_alpha``): a token x
    is typical where p(x) > min(threshold, alpha * exp(-H))."""

    threshold: float = 0.09
    alpha: float = 0.3


def typical_accept(
    tree: DraftTree,
    buffers: TreeBuffers,
    logits: np.ndarray,
    temperature: float = 1.0,
    rule: TypicalRule = TypicalRule(),
    rng: np.random.Generator | None = None,
) -> Acceptance:
    """Medusa's typical acceptance. LOSSY: the output does NOT follow the base distribution.

    With p = softmax(logits / temperature) at a node's parent and H its entropy, a node's token x is
    typical if p(x) > min(rule.threshold, rule.alpha * exp(-H)). The longest all-typical
    root path is accepted, and the bonus is sampled at its last node from p restricted to typical
    tokens (as Medusa does). ``temperature`` 0 falls back to :func:`greedy_accept`. ``rng`` None
    draws the bonus from a fresh, unseeded generator.
    """
    if temperature <= 0:
        return greedy_accept(tree, buffers, logits)
    _check(tree, buffers, logits)
    rng = np.random.default_rng() if rng is None else rng
    n = tree.num_nodes
    ok = np.ones(n + 1, dtype=bool)
    ok[n] = False
    if buffers.internal.size:
        z, log_norm, thresh = _typical(logits[buffers.internal], temperature, rule)
        row = np.full(n, -1, dtype=np.int64)  # node -> row of z
        row[buffers.internal] = np.arange(buffers.internal.size)
        r = row[buffers.parents[1:]]  # [N-1] every non-root node's parent is internal
        ok[1:n] = np.exp(z[r, tree.tokens[1:]] - log_norm[r]) > thresh[r]
    nodes = _longest_path(ok, buffers)
    z, log_norm, thresh = _typical(logits[int(nodes[-1])][None], temperature, rule)
    probs = np.exp(z[0] - log_norm[0])  # [V]
    cut = min(thresh[0], probs.max())  # the argmax always qualifies (thresh > max p needs alpha > 1)
    bonus = sample_from(np.where(probs >= cut, probs, 0.0), rng)
    return Acceptance(nodes, np.append(tree.tokens[nodes[1:]], bonus).astype(np.int64))


def _typical(
    logits: np.ndarray, temperature: float, rule: TypicalRule
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For logit rows [R, V]: scaled logits z [R, V], log-normaliser [R], and the typicality threshold
    min(rule.threshold, rule.alpha * exp(-H)) [R], with H = log Z - E_p[z] so no log over V is needed (log p = z - log Z).
    """
    z = np.array(logits, dtype=np.float64)
    z -= z.max(-1, keepdims=True)
    z *= 1.0 / temperature
    e = np.exp(z)  # [R, V]
    norm = e.sum(-1)  # [R], >= 1 thanks to the max shift
    entropy = np.log(norm) - np.einsum("rv,rv->r", e, z) / norm
    return z, np.log(norm), np.minimum(rule.threshold, rule.alpha * np.exp(-entropy))


__all__ = [
    "Acceptance",
    "TypicalRule",
    "greedy_accept",
    "position_rng",
    "sample_accept",
    "sample_from",
    "seeded_accept",
    "typical_accept",
    "warp_logits",
]
