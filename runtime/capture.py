"""Shape and padding rules for CUDA-graph capture and replay of the tree step (pure numpy, no device).

A captured graph has fixed shapes, so a step is replayed from the graph keyed by
``(batch, capacity bucket, padded T)``:

* **Which steps are captured.** Decode steps only (the cache already holds the prompt) with at most
  ``max_tree`` nodes. A prefill has a different T for every prompt and runs once per generation, so it
  runs uncaptured.
* **Padded T.** A tree of N nodes is padded to the smallest of ``1, 2, 4, ... , max_tree`` that holds
  it (:func:`tree_buckets`, :func:`padded_tree_size`), so a handful of graphs serve every tree size.
* **Capacity bucket.** Padded rows need cache slots too, so the step needs ``length + T_pad`` slots
  (:func:`capacity_needed`); the cache grows to the bucket that holds them. The decode loop keeps
  ``length + N <= max_context`` and T_pad never exceeds ``max_tree``, so the largest bucket
  (``max_context + max_tree``) always suffices.
* **Padded rows are harmless** (:func:`pad_step`):

  - they write their K/V to fresh slots *after* every real row's slot and at or after the committed
    length, so they never overwrite committed or real tree rows; nothing reads those slots as valid:
    the next step's rows overwrite them before any mask makes them visible;
  - every real row's mask hides the padded rows' slots, so real logits are unchanged;
  - each padded row sees exactly its own slot, so its softmax has one finite entry: no NaN or Inf is
    produced that could leak into the cache (a masked slot still enters the matmul with weight 0,
    and ``0 * NaN`` would poison a real row);
  - padded ids repeat the root token and padded positions repeat the last real position, so
    embedding and RoPE stay in range;
  - ``logits_index`` is padded to ``T_pad`` entries with row 0 (a read-only gather) and only the first K
    rows of logits (and the first N hidden rows) are returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backends.base import StepInputs
from .kvcache import KVCache, bucket_for


def chain_feed(ids: np.ndarray, past: int, capacity: int, logits_rows: np.ndarray) -> StepInputs:
    """A chain of ``len(ids)`` tokens after ``past`` committed slots, over a cache of ``capacity`` slots."""
    t, neg = len(ids), np.finfo(np.float32).min
    mask = np.full((1, 1, t, capacity), neg, np.float32)
    mask[..., :past] = 0.0
    mask[0, 0, :, past:past + t] = np.where(np.tril(np.ones((t, t), bool)), 0.0, neg)
    return StepInputs(ids[None].astype(np.int64), (past + np.arange(t))[None], mask, past + np.arange(t),
                      logits_rows.astype(np.int64))


def tree_buckets(max_tree: int) -> tuple[int, ...]:
    """Padded tree sizes: powers of two below ``max_tree``, then ``max_tree`` itself."""
    if max_tree < 1:
        raise ValueError(f"max_tree must be >= 1, got {max_tree}")
    out, t = [], 1
    while t < max_tree:
        out.append(t)
        t *= 2
    out.append(max_tree)
    return tuple(out)


def padded_tree_size(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds ``n`` nodes."""
    return bucket_for(n, buckets, "tree nodes")


def should_capture(length: int, n: int, max_tree: int) -> bool:
    """Decode steps (cache not empty) of at most ``max_tree`` nodes are replayed from graphs."""
    return length > 0 and 1 <= n <= max_tree


def _pad_slot_start(write_indices: np.ndarray, length: int) -> int:
    return max(int(length), int(write_indices.max()) + 1)


def capacity_needed(inputs: StepInputs, length: int, t_pad: int) -> int:
    """Cache slots a step padded to ``t_pad`` rows touches (real slots plus the padded rows' fresh slots)."""
    n = inputs.input_ids.shape[1]
    return _pad_slot_start(inputs.write_indices, length) + (t_pad - n)


@dataclass(frozen=True)
class CaptureKey:
    """Identity of a captured graph: shapes that are baked into it."""

    batch: int
    capacity: int
    t_pad: int


@dataclass(frozen=True)
class PaddedStep:
    """A step padded to fixed shapes, plus how many leading rows are real."""

    inputs: StepInputs  # [B, T_pad] ids/positions, [B, 1, T_pad, C] mask, [T_pad] write/logits indices
    n_real: int  # real rows of T (hidden_states rows to return)
    k_real: int  # real logits rows

    @property
    def key(self) -> CaptureKey:
        b, t = self.inputs.input_ids.shape
        return CaptureKey(int(b), int(self.inputs.attention_mask.shape[3]), int(t))


def pad_step(inputs: StepInputs, t_pad: int, length: int, capacity: int) -> PaddedStep:
    """Pad a step of N rows to ``t_pad`` rows over a cache of ``capacity`` slots (see module docstring).

    ``capacity`` may exceed the mask's width (the cache grew to hold the padded rows): the new
    columns are hidden from the real rows.
    """
    ids, pos, mask = inputs.input_ids, inputs.position_ids, inputs.attention_mask
    widx, lidx = inputs.write_indices, inputs.logits_index
    b, n = ids.shape
    k = len(lidx)
    c_in = mask.shape[3]
    if t_pad < n or t_pad < k:
        raise ValueError(f"cannot pad {n} rows ({k} logits rows) down to {t_pad}")
    if capacity < c_in:
        raise ValueError(f"capacity {capacity} is smaller than the mask width {c_in}")
    start = _pad_slot_start(widx, length)
    extra = t_pad - n
    if start + extra > capacity:
        raise ValueError(f"padded rows need slots up to {start + extra}, beyond capacity {capacity}")
    neg = np.finfo(mask.dtype).min
    pad_slots = np.arange(start, start + extra, dtype=np.int64)

    m = np.full((b, 1, t_pad, capacity), neg, dtype=mask.dtype)  # [B, 1, T_pad, C]
    m[:, :, :n, :c_in] = mask
    m[:, :, :n, pad_slots] = neg  # real rows never see padded rows
    m[:, :, np.arange(n, t_pad), pad_slots] = 0.0  # a padded row sees only its own slot

    p_ids = np.empty((b, t_pad), dtype=ids.dtype)
    p_ids[:, :n] = ids
    p_ids[:, n:] = ids[:, :1]
    p_pos = np.empty((b, t_pad), dtype=pos.dtype)
    p_pos[:, :n] = pos
    p_pos[:, n:] = pos.max(axis=1, keepdims=True)
    p_widx = np.concatenate([widx.astype(np.int64), pad_slots])
    p_lidx = np.concatenate([lidx.astype(np.int64), np.zeros(t_pad - k, dtype=np.int64)])
    padded = StepInputs(p_ids, p_pos, m, p_widx, p_lidx)
    return PaddedStep(padded, n_real=n, k_real=k)


def prepare_captured_step(inputs: StepInputs, cache: KVCache, t_buckets: tuple[int, ...],
                          capacity_buckets: tuple[int, ...]) -> PaddedStep | None:
    """The padded step to replay for ``inputs``, growing ``cache`` to hold its padded rows; None: run it uncaptured."""
    n = inputs.input_ids.shape[1]
    if not should_capture(cache.length, n, t_buckets[-1]):
        return None
    t_pad = padded_tree_size(n, t_buckets)
    cache.ensure_capacity(capacity_needed(inputs, cache.length, t_pad), capacity_buckets)
    return pad_step(inputs, t_pad, cache.length, cache.capacity)
