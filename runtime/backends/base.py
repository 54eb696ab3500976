"""The one interface every backend implements: ``load(bundle) / step(inputs, cache) / close()``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Self

import numpy as np

from ..bundle import BundleManifest, GraphEntry
from ..kvcache import KVCache


@dataclass(frozen=True)
class StepInputs:
    """One decoder step; see ``graphs/base_step.py`` for the graph contract."""

    input_ids: np.ndarray  # [B, T] int64
    position_ids: np.ndarray  # [B, T] int64
    attention_mask: np.ndarray  # [B, 1, T, C] float, additive
    write_indices: np.ndarray  # [T] int64 cache slots for the new rows
    logits_index: np.ndarray  # [K] int64 rows of T whose logits are returned


@dataclass(frozen=True)
class StepOutputs:
    logits: np.ndarray  # [B, K, V] on the host
    hidden_states: np.ndarray  # [B, T, H] on the host


class Backend(ABC):
    """Runs the bundle's base graph. Subclasses own device memory; use as a context manager."""

    name: str = "backend"
    manifest: BundleManifest
    # Row-exact steps (on by force for graphs that quantize activations to int8, or asked for): a
    # chain node's row must be bitwise the row a plain step computes for the same token, so drafts
    # are chains and every step runs at least ``min_rows`` rows. Rows of a multi-row step are
    # bitwise independent of how many there are; a 1-row step is too only on a graph that pads its
    # attention to two rows itself (``GraphEntry.attention_rows``), else ``min_rows`` is 2.
    row_exact: bool = False
    min_rows: int = 1

    def set_row_exact(self, exact: bool, graph: GraphEntry) -> None:
        """Turn row-exact steps on or off for steps run on ``graph`` (sets ``row_exact`` and ``min_rows``)."""
        self.row_exact = exact
        self.min_rows = graph.row_exact_rows if exact else 1

    @abstractmethod
    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A zeroed cache of ``capacity`` slots."""

    @abstractmethod
    def step(self, inputs: StepInputs, cache: KVCache) -> StepOutputs:
        """Run one step; the T new K/V rows are written into ``cache`` in place at ``write_indices``."""

    @property
    def mask_dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def close(self) -> None:
        """Release sessions and buffers."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
