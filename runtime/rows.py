"""A step's rows: several sequences, each with its root and draft rows, laid out as one step of the graph.

Every sequence is one batch row of the step and holds its token ``i`` at cache column ``i`` of its own
cache row, as it does alone. Its step rows are its root and its draft nodes (parents first), padded to the
step's ``T`` with dummy nodes: a chain under its last node, whose rows are written past its own and dropped
(a later step overwrites them; the mask hides them). Row ``j`` of sequence ``b`` sits at column ``past_b +
j`` and position ``past_b + depth_j``; it sees the sequence's past and its own ancestors in the step, and
nothing of the other sequences. The graph writes row ``b`` at ``write_indices + position_ids[b, 0] -
position_ids[0, 0]`` (its root's position is its past), so ``write_indices`` is row 0's columns.

Which graph computes a row the same whatever else the step holds (other sequences, its own draft rows,
padding) is the machine's business: the step plan's probe checks it bit for bit (:func:`.probe.probe_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .backends.base import StepInputs
from .tree import DraftTree


@dataclass(frozen=True)
class SeqRows:
    """One sequence's share of a step: ``past`` tokens already in its cache row, then ``tree``'s nodes."""

    past: int
    tree: DraftTree

    @property
    def rows(self) -> int:
        return len(self.tree.tokens)


def padded(tree: DraftTree, rows: int) -> DraftTree:
    """``tree`` with dummy nodes up to ``rows``: a chain under its last node (their outputs are dropped)."""
    n = len(tree.tokens)
    if n >= rows:
        return tree
    tokens = np.concatenate([tree.tokens, np.repeat(tree.tokens[-1:], rows - n)])
    return DraftTree(tokens, np.concatenate([tree.parents, np.arange(n - 1, rows - 1)]))


def step_inputs(seqs: Sequence[SeqRows], rows: int, capacity: int, mask_dtype: np.dtype,
                batch: int | None = None) -> StepInputs:
    """The step of ``seqs`` at ``rows`` rows each (at least each one's own), over a cache of ``capacity``
    columns; ``batch`` rows in all, the ones past ``len(seqs)`` copies of the first sequence (dropped)."""
    b = batch or len(seqs)
    neg = np.finfo(mask_dtype).min
    ids = np.empty((b, rows), dtype=np.int64)
    pos = np.empty((b, rows), dtype=np.int64)
    mask = np.full((b, 1, rows, capacity), neg, dtype=mask_dtype)  # [B, 1, T, C]
    for r in range(b):
        seq = seqs[r] if r < len(seqs) else seqs[0]
        tree = padded(seq.tree, rows)
        buf = tree.buffers()
        p = seq.past
        ids[r] = tree.tokens
        pos[r] = p + buf.depth
        mask[r, 0, :, :p] = 0.0
        mask[r, 0, :, p : p + rows] = np.where(buf.mask, 0.0, neg)
    return StepInputs(ids, pos, mask, seqs[0].past + np.arange(rows, dtype=np.int64),
                      np.arange(rows, dtype=np.int64))


def rows_per_sequence(expected: list[list[float]], cost: Callable[[int], float], min_rows: int = 1) -> int:
    """The rows ``T`` each sequence brings to a step of several (1: plain), the most expected tokens per unit of cost.

    ``expected[b][j]``: sequence ``b``'s expected tokens when ``j`` of its draft tokens are verified (its draft
    has ``len(expected[b]) - 1``); ``cost(rows)``: a step of that many rows in all, ``B x max(T, min_rows)``."""
    b = len(expected)
    best_t, best = 1, sum(e[0] for e in expected) / cost(b * max(1, min_rows))
    for t in sorted({len(e) for e in expected if len(e) > 1}):
        value = sum(e[min(len(e), t) - 1] for e in expected) / cost(b * max(t, min_rows))
        if value > best:
            best_t, best = t, value
    return best_t


MAX_WAIT = 4  # steps in a row a sequence may sit out while another runs alone


def lone_step(expected: list[list[float]], cost: Callable[[int], float], min_rows: int, rows: int,
              waited: Sequence[int]) -> tuple[int, int] | None:
    """The sequence that should run alone this step, and its rows: where one sequence's draft returns more tokens
    per unit of cost verified alone than the whole batch's step at ``rows`` rows each (:func:`rows_per_sequence`'s
    choice; ``expected`` and ``cost`` as there), the others sit it out, their drafts kept for the next step. A
    batch's step pads every sequence to the longest one's rows, so a long near-certain draft (an answer the suffix
    cache has met before) pays alone where beside three short ones it would not. None: the whole batch steps, as it
    does where a sequence has sat out :data:`MAX_WAIT` steps in a row."""
    if any(w >= MAX_WAIT for w in waited):
        return None
    b = len(expected)
    best = sum(e[min(len(e), rows) - 1] for e in expected) / cost(b * max(rows, min_rows))
    found = None
    for i, e in enumerate(expected):
        for t in range(2, len(e) + 1):
            value = e[t - 1] / cost(max(t, min_rows))
            if value > best:
                best, found = value, (i, t)
    return found


@dataclass
class _ModeSums:
    """One mode's iterations in a pool: tokens per sequence and seconds, fading by :attr:`LoadGate.RATE` an
    iteration (the rate is the one over the other)."""

    tokens: float = 0.0
    seconds: float = 0.0
    iterations: int = 0
    fresh: bool = False  # its next iteration starts the sums over (a block of the mode not in use)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Pool:
    """A pool's state in the load gate: both modes' sums, the mode in use once learned, and its blocks."""

    every: int  # iterations between two blocks of the mode not in use, now
    sums: dict[bool, _ModeSums] = field(default_factory=lambda: {True: _ModeSums(), False: _ModeSums()})
    mode: bool | None = None  # the mode in use, once learned (changed only as a block ends)
    block: tuple[bool, int] | None = None  # (the mode explored, its iterations left)
    since: int = 0  # iterations since the last block


class LoadGate:
    """Whether the sequences of a step of several ask their whole drafters or only their recall of text met before
    (:meth:`~.drafters.base.Drafter.recall`: the suffix cache; lookup, n-grams and trained drafts have none): by
    measured tokens per second of whole iterations in each mode (their proposals, trained drafts' calls and draft
    rows all included).

    The rows rule (:func:`rows_per_sequence`) prices draft rows, but by the time it runs every drafter has drafted;
    at high load the calls alone (a trained draft's, and lookup's at many sequences) can cost more than the rows
    return, and rows it lets in on estimated chances can return less than they cost. The recall is asked in
    either mode: its calls cost next to nothing, the rows rule prices its rows one step at a time, and it goes on
    learning, so an answer met before lands whatever the gate says.

    Batch sizes are pooled by powers of two (2, 3-4, 5-8, 9-16, ...): a server's batch drains and refills one
    sequence at a time, and a gate that learned each size apart would still be exploring when the size changed.
    Each pool first alternates the two modes, a few iterations each (:meth:`needed`: so both see the same sizes
    and the same text), and from then on runs the mode with the higher rate per sequence (a pool larger than one
    that runs plain starts plain, unlearned: :meth:`_inherits_plain`), trying the other for a short block
    (:meth:`block`) after :attr:`EXPLORE` iterations, so that a change of load or text is seen. A block changes
    the mode only where it beats the mode in use by :attr:`MARGIN` (a block of a few iterations is noisy, and
    each change that noise makes runs the slower mode until the next block); where it does not, the next block
    comes twice as late (up to :attr:`EXPLORE_MAX`): at high load a drafting block calls every sequence's trained
    draft.

    A rate is a ratio of sums (tokens per sequence over seconds) that fades by :attr:`RATE` an iteration, so a mode
    in use reads the recent steps. The mode changes only as a block ends, and a block starts the other mode's sums
    afresh: steps slow down as contexts grow and requests come and go, and a rate kept from long ago, compared
    with the fresh one of the mode in use, would flip the gate to whichever mode it had used least lately."""

    MIN = 8  # iterations of a mode in a pool before its rate counts (fewer in large pools: see :meth:`needed`)
    SAMPLES = 64  # sequence-iterations that suffice: a pool of 32 learns a mode in 3 iterations, not 8
    EXPLORE = 64  # iterations between two blocks of the mode not in use, at first
    EXPLORE_MAX = 1024  # ... doubling each time a block leaves the mode as it was, up to this
    MARGIN = 0.05  # a block changes the mode only where its rate beats the mode in use by this share
    RATE = 0.1  # how fast a mode's sums fade per iteration it runs (plain sums over its first 1 / RATE)

    def __init__(self) -> None:
        self._pools: dict[int, _Pool] = {}

    @staticmethod
    def pool(batch: int) -> int:
        """The batch sizes measured together: up to the next power of two (3 and 4 -> 4; 17-32 -> 32)."""
        return 1 << max(1, (batch - 1).bit_length())

    @classmethod
    def needed(cls, pool: int) -> int:
        """Iterations of each mode before a pool's rates count: each iteration of a large pool averages over many
        sequences, and one drafting iteration there calls every sequence's drafter (a trained draft: a model call
        each)."""
        return max(3, min(cls.MIN, cls.SAMPLES // pool))

    @classmethod
    def block(cls, pool: int) -> int:
        """Iterations of a block of the mode not in use: half of :meth:`needed`, at least 2."""
        return max(2, cls.needed(pool) // 2)

    def rate(self, pool: int, drafting: bool) -> float:
        """Tokens per second per sequence of a pool's mode (0 before it ran)."""
        state = self._pools.get(pool)
        return 0.0 if state is None else state.sums[drafting].rate

    def _state(self, pool: int) -> _Pool:
        if pool not in self._pools:
            self._pools[pool] = _Pool(every=self.EXPLORE)
        return self._pools[pool]

    def drafting(self, batch: int) -> bool:
        key = self.pool(batch)
        pool = self._state(key)
        if pool.mode is None and self._inherits_plain(key):
            pool.mode = False  # a smaller pool found plain faster: from there on rows only cost more
        if pool.mode is None:  # learning: the mode measured less next, drafting first
            n_draft, n_plain = pool.sums[True].iterations, pool.sums[False].iterations
            if min(n_draft, n_plain) < self.needed(key):
                return n_draft <= n_plain
            pool.mode = pool.sums[True].rate >= pool.sums[False].rate
        if pool.block is not None:
            explored, left = pool.block
            if left > 0:
                pool.block = (explored, left - 1)
                return explored
            pool.block = None  # it has just ended: its fresh rate against the recent steps' decides
            if pool.sums[explored].rate > (1 + self.MARGIN) * pool.sums[not explored].rate:
                pool.mode, pool.every = explored, self.EXPLORE
            else:  # the mode stands: the next block comes twice as late
                pool.every = min(2 * pool.every, self.EXPLORE_MAX)
        pool.since += 1
        if pool.since >= pool.every:
            pool.since = 0
            other = not pool.mode
            pool.block = (other, self.block(key) - 1)
            pool.sums[other].fresh = True
            return other
        return pool.mode

    def _inherits_plain(self, pool: int) -> bool:
        """Whether the largest smaller pool learned runs plain. A draft row competes with more sequences' rows the
        fuller the step, and each sequence's drafter call costs the same, so drafting that lost at a smaller batch
        loses at a larger one: such a pool starts plain without learning drafting (a drafting iteration of 32
        sequences calls 32 trained drafts), and its blocks still try drafting now and then."""
        smaller = [p for p, state in self._pools.items() if p < pool and state.mode is not None]
        return bool(smaller) and not self._pools[max(smaller)].mode

    def record(self, batch: int, drafting: bool, tokens: int, seconds: float) -> None:
        """An iteration of ``batch`` sequences: ``tokens`` emitted in ``seconds``."""
        if seconds <= 0 or batch < 1:
            return
        sums = self._state(self.pool(batch)).sums[drafting]
        if sums.fresh:
            sums.fresh, sums.tokens, sums.seconds = False, 0.0, 0.0
        sums.iterations += 1
        keep = 1.0 if sums.iterations * self.RATE <= 1 else 1.0 - self.RATE
        sums.tokens = keep * sums.tokens + tokens / batch  # per sequence: a pool's sizes differ
        sums.seconds = keep * sums.seconds + seconds
