"""The preallocated, in-place KV cache and its capacity buckets.

Layout per layer: ``key[i], value[i]: [B, Hkv, C, D]`` where C is the capacity bucket. Slots
``[0, length)`` hold committed tokens; a step writes its T new rows at ``[length, length + T)`` (the
tree region). After verification :meth:`KVCache.commit` moves the accepted nodes' rows to the
front of the tree region; rejected rows are simply overwritten by the next step, because the
attention mask hides every slot at or past ``length`` that is not part of the current tree.

The arrays are whatever the backend allocates (numpy on the CPU, torch tensors on CUDA); only
basic and advanced indexing is used, which both support.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_BUCKET = 256
SMALL_PAGES_FROM = 4 << 20  # bytes: numpy asks the kernel for huge pages for arrays this large


def zeroed(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed host buffer, in ordinary pages where it is large.

    numpy advises the kernel to back arrays of 4 MiB and more with 2 MiB huge pages, and where transparent huge
    pages are on "madvise" (the common default) the first write into each one may wait for the kernel to compact
    memory. A batch's cache is such an array, written a row at a time as requests join: on the Xeon (family 6
    model 167), copying 32 joining MT-bench prompts' K/V into the main bundle's cache took 0.98 s in huge pages
    and 0.08 s in ordinary ones, where the decode steps then met some 60,000 more first touches of a 4 KiB page
    (about 1.7 us each here). So a large buffer is an anonymous mapping of its own (zeroed by the kernel,
    unmapped with the array); a small one is numpy's."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    if size < SMALL_PAGES_FROM:
        return np.zeros(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, size), dtype=dtype).reshape(shape)


def capacity_buckets(max_context: int, max_tree: int, min_bucket: int = MIN_BUCKET) -> tuple[int, ...]:
    """Doubling capacities from ``min_bucket`` up to ``max_context + max_tree`` (the last one exact)."""
    limit = max_context + max_tree
    out, c = [], min_bucket
    while c < limit:
        out.append(c)
        c *= 2
    out.append(limit)
    return tuple(out)


def bucket_for(needed: int, buckets: Sequence[int], what: str = "cache slots") -> int:
    """The smallest of the ascending ``buckets`` that holds ``needed`` (capacities, padded tree sizes)."""
    for b in buckets:
        if b >= needed:
            return b
    raise ValueError(f"{needed} {what} exceed the largest bucket {buckets[-1]}")


@dataclass
class KVCache:
    """Per-layer K/V buffers plus the committed length. Mutated in place by steps and commits."""

    keys: list[Any]  # [B, Hkv, C, D] per layer
    values: list[Any]
    length: int  # committed tokens
    allocate: Callable[[tuple[int, ...]], Any]  # backend allocator of a zeroed buffer
    epoch: int = 0  # bumped whenever the buffers are replaced (a backend's bindings then go stale)

    @classmethod
    def allocate_for(cls, num_layers: int, num_kv_heads: int, head_dim: int, batch: int, capacity: int,
                     allocate: Callable[[tuple[int, ...]], Any]) -> KVCache:
        """A zeroed cache of ``capacity`` slots built with a backend's allocator."""
        shape = (batch, num_kv_heads, capacity, head_dim)
        keys = [allocate(shape) for _ in range(num_layers)]
        values = [allocate(shape) for _ in range(num_layers)]
        return cls(keys, values, 0, allocate)

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    @property
    def batch(self) -> int:
        return int(self.keys[0].shape[0])

    def buffers(self) -> list[Any]:
        """Interleaved [key_0, value_0, key_1, ...], the order of the graph's past inputs."""
        return [b for kv in zip(self.keys, self.values) for b in kv]

    def ensure_capacity(self, needed: int, buckets: Sequence[int]) -> bool:
        """Grow to the bucket that holds ``needed`` slots; returns True if it reallocated."""
        if needed <= self.capacity:
            return False
        cap = bucket_for(needed, buckets)
        n = self.length
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                shape = (old.shape[0], old.shape[1], cap, old.shape[3])
                new = self.allocate(shape)
                new[:, :, :n] = old[:, :, :n]
                bufs[i] = new
        self.epoch += 1
        return True

    def commit(self, accepted_slots: np.ndarray) -> None:
        """Move the K/V rows of accepted tree nodes (absolute slots) to ``length..`` and extend length.

        ``accepted_slots`` is increasing and starts at ``length`` (the root), so a chain that was
        accepted in order needs no move at all. That case (a plain step, any chain step) is decided on
        two Python ints: small numpy calls are slow right after a step (see verify._chain_accept).
        """
        n = len(accepted_slots)
        if int(accepted_slots[-1]) != self.length + n - 1:  # increasing from length: else a gap to close
            dst = np.arange(self.length, self.length + n)
            src = np.asarray(accepted_slots)
            for bufs in (self.keys, self.values):
                for b in bufs:
                    b[:, :, dst] = b[:, :, src]  # advanced indexing copies the source first
        self.length += n

    def commit_row(self, row: int, start: int, nodes: np.ndarray) -> None:
        """Row ``row``'s accepted tree ``nodes`` (increasing, from its root at column ``start``) moved to
        ``start..``; the chain case, a prefix, moves nothing (decided on two Python ints)."""
        n = len(nodes)
        if int(nodes[-1]) != n - 1:
            dst = np.arange(start, start + n)
            src = start + np.asarray(nodes)
            for bufs in (self.keys, self.values):
                for b in bufs:
                    b[row, :, dst] = b[row, :, src]  # advanced indexing copies the source first
