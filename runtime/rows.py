"""A step's rows: several sequences, each with its root and draft rows, laid out as one step of the graph.

Every sequence is one batch row of the step and holds its token ``i`` at cache column ``i`` of its own
cache row, as it does alone. Its step rows are its root and its draft nodes (parents first), padded to the
step's ``T`` with dummy nodes: a chain under its last node, whose rows are written past its own and dropped
(a later step overwrites them; the mask hides them). Row ``j`` of sequence ``b`` sits at column ``past_b +
j`` and position ``past_b + depth_j``; it sees the sequence's past and its own ancestors in the step, and
nothing of the other sequences. The graph writes row ``b`` at ``write_indices + position_ids[b, 0] -
position_ids[0, 0]`` (its root's position is its past), so ``write_indices`` is row 0's columns.

Which graph computes a row the same whatever else the step holds (other sequences, its own draft rows,
padding) is the machine's business: the step plan's probe checks it bit for bit (:func:`probe_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .backends.base import StepInputs
from .bitwise import gap, host_copy
from .plan import ProbeCheck
from .tree import DraftTree

if TYPE_CHECKING:
    from .decode import Decoder
    from .kvcache import KVCache


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


# --- the probe: a sequence's rows among other sequences' -----------------------------------------------
ROWS_PROMPT = 300  # the probed sequence's context: past 256 columns, where ONNX Runtime's products block sums
_OTHERS = (-37, 23, -90, 61, -5)  # the other sequences' context lengths, against the probed one's


def probe_rows(dec: Decoder, tokens: Sequence[int]) -> list[ProbeCheck]:
    """Whether a sequence's rows are, bit for bit, its rows alone when other sequences share the step.

    The sequence's plain steps of ``tokens[0..2]`` alone, on ``dec``'s plan (its padding rows included), are
    the reference. Then the same sequence runs in batches whose other sequences hold other text of other
    lengths, in a cache of another capacity, each prompt prefilled alone and copied in (as the scheduler joins
    one): as row 1 of 3 verifying the chain ``tokens[0..2]`` beside a plain row and a 2-row chain (so with
    its own draft rows and padding rows), and as row 4 of 6 plain steps. Logits, hidden states and the K/V
    it writes must all agree."""
    backend, manifest = dec.backend, dec.manifest
    v = manifest.model.vocab_size
    n = max(8, min(ROWS_PROMPT, manifest.limits.max_context - max(_OTHERS) - 2 * dec.max_tree - 8))

    def prompt(seed: int, length: int) -> list[int]:
        return [(seed + 7919 * i) % v for i in range(length)]

    state, _ = dec.prefill(prompt(17, n))
    alone = []
    for i in range(3):  # plain steps, as Decoder.verify runs them on this plan
        root = DraftTree.root(tokens[i])
        out = dec.verify(state, root, root.buffers())
        kv = [host_copy(b[0, :, n + i]) for b in state.cache.buffers()]
        alone.append((host_copy(out.logits[0, 0]), host_copy(out.hidden_states[0, 0]), kv))
        state.cache.length += 1
    mine = (prompt(17, n), state.cache)
    others = [prompt(5 + 97 * j, max(4, n + d)) for j, d in enumerate(_OTHERS)]  # a short context: shorter others
    joined: dict[int, KVCache] = {}

    def batch(spec: list[tuple[list[int], DraftTree]], row: int) -> list[tuple]:
        cache = backend.new_cache(len(spec), max(len(p) for p, _ in spec) + 2 * dec.max_tree + 24)
        for r, (ids, _) in enumerate(spec):
            src = mine[1] if ids is mine[0] else joined.get(id(ids))
            if src is None:
                src = joined[id(ids)] = dec.prefill(ids)[0].cache
            for dst, buf in zip(cache.buffers(), src.buffers()):
                dst[r, :, : len(ids)] = buf[0, :, : len(ids)]
        backend.forget_buffers()  # nothing may alias the caches made so far
        rows = max(max(len(t.tokens) for _, t in spec), dec.min_rows)
        out = backend.step(step_inputs([SeqRows(len(p), t) for p, t in spec], rows, cache.capacity,
                                       backend.mask_dtype), cache)
        backend.forget_buffers()
        k = len(spec[row][1].tokens)
        return [(out.logits[row, j], out.hidden_states[row, j], [host_copy(b[row, :, n + j]) for b in cache.buffers()])
                for j in range(k)]

    chain = DraftTree(np.asarray(tokens[:3]), np.arange(-1, 2))
    runs = {
        "batch rows: 3 sequences, its chain of 3": batch(
            [(others[0], DraftTree.root(3)), (mine[0], chain), (others[1], DraftTree.chain([5, 6]))], 1),
        "batch rows: 6 sequences, plain": batch(
            [(others[0], DraftTree.root(3)), (others[1], DraftTree.root(4)), (others[2], DraftTree.root(5)),
             (others[3], DraftTree.root(6)), (mine[0], DraftTree.root(tokens[0])), (others[4], DraftTree.root(7))], 4),
    }
    checks = []
    for what, got in runs.items():
        worst = max(max(gap(a[0], b[0]), gap(a[1], b[1]), max(gap(x, y) for x, y in zip(a[2], b[2])))
                    for a, b in zip(alone, got))
        checks.append(ProbeCheck(what, worst))
    backend.forget_buffers()
    return checks
