"""The one interface every backend implements: ``load(bundle) / step(inputs, cache) / close()``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Self

import numpy as np

from ..bundle import BundleManifest
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
    # The fewest rows a step may have. 2 on graphs that quantize activations to int8: ONNX Runtime's
    # 1-row int8 kernel rounds differently from its kernel for two or more rows, whose rows are
    # bitwise independent of how many there are. Steps of >= 2 rows make a plain step's row and a
    # chain node's row the same computation, so speculative output equals plain output exactly.
    min_rows: int = 1

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
