"""The ``ort-tree`` graph's attention: every row attends over its keys gathered into plain-step order.

The fused graph's ``GroupQueryAttention`` scores a tree step's rows over the step's cache slots as they
lie: a node's masked siblings sit between its ancestors and itself, so its ancestors' terms take other
places in the softmax sum and the probabilities x values sum than a plain step gives them, and a tree
row differs from the plain row of the same token (by up to 1.9 in the logits of the q4_1 main bundle on
an AMD EPYC). Here each row instead reads its own key sequence, built the way a plain step would see it:
the past in place, then its ancestors by depth, then itself, then the rest of the step's slots masked
at the end. A masked non-ancestor then never shifts another element's place in a reduction; only the
number of masked slots at the end varies with the step (a chain's row ``t`` carries ``T - t - 1`` of
them), which the step plan's probe checks on the machine (``runtime/plan.py``).

The order comes from the step's own ``attention_mask``: the runtime lists tree nodes parents first, at
slots ``past + row``, so a row's visible slots in ascending order are exactly its ancestors by depth
and then itself (no input is added to the contract). Each row's probabilities x values product is a GEMM
of its own (a batch entry per row: ``G`` query heads by ``past + T`` slots), so that product has one shape
in every row of every step, plain or tree; each score is a dot product of its own. K/V are rotated as in any
other graph and written in place, a ``ScatterND`` row copy per new row and head (``ScatterElements``
resolves each element on its own: about 12 times as long at 32 sequences on the Xeon family 6 model 167), and
the scores are one product of the queries with the cache's keys as they lie (``FusedMatMul``, the keys
transposed in its packing, so no transpose of the scores follows it).

Cost: each row copies its ``past + T`` value rows once per layer, and the attention is some 20 nodes a
layer where the fused graph has one. On the q4_1 main bundle (AMD EPYC family 26, 2 threads) a plain step
costs about 1.2 fused plain steps (docs/benchmarks.md, "Exact trees on a CPU"); the step plan's choice
(``runtime/plan_choice.py``) takes this graph only where its plain step costs at most ``GATHERED_MAX_COST``
times the fastest chain plan's, since every plain step pays for it.
"""

from __future__ import annotations

import numpy as np

MS = "com.microsoft"


class GatherOrder:
    """Per-step tensors every layer shares (built once by :func:`gather_order`)."""

    def __init__(self, g, score_idx: str, value_idx: str, mask: str, total_1d: str, write: str, score_shape: str,
                 head_dim: int):
        self.score_idx = score_idx  # [B, Hkv, T, G, total]: the slot each sorted score reads
        self.value_idx = value_idx  # [B, Hkv, T, total]: the row of the flat [B*Hkv*C, D] cache each sorted value is
        self.mask = mask  # [B, 1, T, 1, total]: the additive mask in sorted order
        self.total_1d = total_1d  # [1]: past + T
        self.write = write  # [B, Hkv, T, 3]: each new K/V row's (row, head, column), as ScatterND takes them
        self.score_shape = score_shape  # [B, Hkv, T, G, C]
        self.flat_rows = g.const([-1, head_dim])


def gather_order(g, mask: str, write: str, positions: str, total: str, capacity: str,
                 heads: tuple[int, int, int]) -> GatherOrder:
    """The sorted order of each row's slots from ``mask`` ``[B, 1, T, total]`` (already sliced to the
    ``total`` slots the step reaches): the slots a row sees in ascending order (its past, then its ancestors
    by depth, then itself), then those it does not see (the cache's unused slots ``total .. C-1`` after
    them, for the values).

    Several sequences may share the step, one per batch row, each at the cache columns it holds alone
    (token ``i`` at column ``i``): row ``b`` writes at ``write_indices + position_ids[b, 0] -
    position_ids[0, 0]`` (its root's position is its past length), and ``total`` is the longest row's
    past + T. A row of a shorter sequence then sees the same slots in the same order as
    alone, with more unseen slots at the end, which the probe checks on the machine (``runtime/plan.py``).
    ``total`` and ``capacity`` are int64 scalars; ``heads`` is (query heads, KV heads, head dim)."""
    hq, hkv, d = heads
    group = hq // hkv
    one, zero = g.const(1), g.const(0)
    total_1d, cap_1d = (g.one("Unsqueeze", [s, g.const([0])]) for s in (total, capacity))
    cols = g.one("Range", [zero, total, one])  # [total]
    # visible slots keep their column j, hidden ones sort after every visible one (j + total)
    hidden = g.one("Cast", [g.one("Less", [mask, g.const(0.0, np.float32)])], to=7)  # 1 where masked
    key = g.one("Add", [cols, g.one("Mul", [hidden, total])])  # [B, 1, T, total]
    _, perm = g.op("TopK", [key, total_1d], 2, axis=-1, largest=0, sorted=1)  # ascending keys
    sorted_mask = g.one("GatherElements", [mask, perm], axis=3)  # [B, 1, T, total]
    sorted_mask = g.one("Unsqueeze", [sorted_mask, g.const([3])])  # [B, 1, T, 1, total]
    bt = g.one("Shape", [mask])  # [B, 1, T, total]
    batch = g.one("Slice", [bt, g.const([0]), g.const([1])])  # [1]
    t_1d = g.one("Slice", [bt, g.const([2]), g.const([3])])  # [1]
    perm5 = g.one("Unsqueeze", [perm, g.const([3])])  # [B, 1, T, 1, total]
    score_shape = g.one("Concat", [batch, g.const([hkv]), t_1d, g.const([group]), total_1d], axis=0)
    score_idx = g.one("Expand", [perm5, score_shape])  # [B, Hkv, T, G, total]
    # value rows of the flat [B*Hkv*C, D] cache: (b * Hkv + h) * C + perm
    n_bh = g.one("Mul", [g.one("Reshape", [batch, g.const([])]), g.const(hkv)])
    base = g.one("Mul", [g.one("Reshape", [g.one("Range", [zero, n_bh, one]),
                                           g.one("Concat", [batch, g.const([hkv, 1, 1])], axis=0)]), capacity])
    value_idx = g.one("Add", [base, perm])  # [B, Hkv, T, total]
    # each row's slots: write_indices shifted by its root's position against row 0's
    first = g.one("Slice", [positions, g.const([0]), g.const([1]), g.const([1])])  # [B, 1]
    offset = g.one("Sub", [first, g.one("Gather", [first, zero], axis=0)])  # [B, 1]
    rows_write = g.one("Add", [g.one("Unsqueeze", [write, g.const([0])]), offset])  # [B, T]
    # ScatterND's index of each new K/V row, (b, h, column) [B, Hkv, T, 3]: a row copy each
    write_shape = g.one("Concat", [batch, g.const([hkv]), t_1d, g.const([1])], axis=0)
    b_idx = g.one("Reshape", [g.one("Range", [zero, g.one("Reshape", [batch, g.const([])]), one]), g.const([-1, 1, 1, 1])])
    parts = [b_idx, g.const(np.arange(hkv, dtype=np.int64).reshape(1, hkv, 1, 1)),
             g.one("Unsqueeze", [rows_write, g.const([1, 3])])]
    write_idx = g.one("Concat", [g.one("Expand", [x, write_shape]) for x in parts], axis=3)  # [B, Hkv, T, 3]
    score_shape_c = g.one("Concat", [batch, g.const([hkv]), t_1d, g.const([group]), cap_1d], axis=0)
    return GatherOrder(g, score_idx, value_idx, sorted_mask, total_1d, write_idx, score_shape_c, d)


def gathered_attention(g, qkv: str, positions: str, order: GatherOrder, past_k: str, past_v: str,
                       pres_k: str, pres_v: str, cos: str, sin: str, heads: tuple[int, int, int], scale: float) -> str:
    """One layer's attention from the packed ``qkv`` ``[B, T, (Hq + 2 Hkv) D]``: rotary at ``positions``,
    the new K/V written into the cache at ``order.write`` (``present`` aliases ``past``), each row's scores and
    values in its sorted order (:func:`gather_order`). Returns the context ``[B, T, Hq D]``.

    The scores are one product of the step's queries with the cache's keys as they lie (each score a dot
    product of its own), cut to the valid ``past + T`` slots and put in each row's order; each row's
    probabilities then multiply its own copy of the values in that order (a ``G x (past + T)`` product
    per row, the same shape for every row of every step)."""
    hq, hkv, d = heads
    group = hq // hkv
    heads_t = g.one("Transpose", [g.one("Reshape", [qkv, g.const([0, 0, hq + 2 * hkv, d])])], perm=[0, 2, 1, 3])
    q, k, v = g.op("Split", [heads_t, g.const([hq, hkv, hkv])], 3, axis=1)  # [B, H, T, D] each
    q = g.one("RotaryEmbedding", [q, positions, cos, sin], MS, interleaved=0)
    k = g.one("RotaryEmbedding", [k, positions, cos, sin], MS, interleaved=0)
    keys = g.op("ScatterND", [past_k, order.write, k], outputs=[pres_k])[0]  # [B, Hkv, C, D]
    values = g.op("ScatterND", [past_v, order.write, v], outputs=[pres_v])[0]
    # q as [B, Hkv, T*G, D] (row t*G + g): one product with the cache's keys as they lie, scaled after it
    q = g.one("Reshape", [g.one("Transpose", [g.one("Reshape", [q, g.const([0, hkv, group, -1, d])])],
                                 perm=[0, 1, 3, 2, 4]), g.const([0, 0, -1, d])])
    scores = g.one("FusedMatMul", [q, keys], MS, transB=1, alpha=scale)  # [B, Hkv, T*G, C]
    scores = g.one("Slice", [g.one("Reshape", [scores, order.score_shape]), g.const([0]), order.total_1d,
                             g.const([4])])  # [B, Hkv, T, G, total]
    scores = g.one("Add", [g.one("GatherElements", [scores, order.score_idx], axis=4), order.mask])
    probs = g.one("Softmax", [scores], axis=-1)
    rows = g.one("Gather", [g.one("Reshape", [values, order.flat_rows]), order.value_idx], axis=0)  # [B,Hkv,T,total,D]
    ctx = g.one("Transpose", [g.one("MatMul", [probs, rows])], perm=[0, 2, 1, 3, 4])  # [B, T, Hkv, G, D]
    return g.one("Reshape", [ctx, g.const([0, 0, hq * d])])
