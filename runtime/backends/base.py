"""The one interface every backend implements: ``load(bundle) / step(inputs, cache) / close()``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

import numpy as np

from ..bundle import BundleManifest, GraphEntry
from ..kvcache import KVCache

if TYPE_CHECKING:
    from ..drafters.base import Drafter


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
    layer_states: np.ndarray | None = None  # [B, T, taps*H]: a graph with feature_layers only
    # [B, K] int64, each logits row's argmax (first maximum), where the backend computes it beside the
    # logits (on a GPU: then greedy verification reads no logits row back). None: taken from ``logits``.
    argmax: np.ndarray | None = None

    def first(self, logits_rows: int, rows: int) -> StepOutputs:
        """The first ``logits_rows`` logits and the first ``rows`` rows of the per-row outputs."""
        layers = None if self.layer_states is None else self.layer_states[:, :rows]
        argmax = None if self.argmax is None else self.argmax[:, :logits_rows]
        return StepOutputs(self.logits[:, :logits_rows], self.hidden_states[:, :rows], layers, argmax)


class Backend(ABC):
    """Runs the bundle's base graph. Subclasses own device memory; use as a context manager."""

    name: str = "backend"
    manifest: BundleManifest
    threads: int = 0  # intra-op threads, part of the exactness verdict's key (0: not applicable)
    # Whether the backend has a second graph for 1-row steps (``split`` step plans, see runtime/plan_choice.py).
    can_split: bool = False
    # Whether steps return ``layer_states`` (a graph exported with feature_layers, on a backend that binds it).
    layer_states: bool = False

    # Whether the backend runs a form of the base step whose rows attend over their keys in plain-step order
    # (``gathered`` step plans, exact trees by construction; see exporter/export/ort_gathered.py).
    can_gather: bool = False
    # Whether that gathered form takes rows of several sequences, each at its own cache columns (row b written at
    # write_indices shifted by its root's position against row 0's): what batching runs (runtime/rows.py).
    can_batch_rows: bool = False

    def use_split(self, on: bool) -> None:
        """Run 1-row steps on the 1-row graph (``on``) or every step on the multi-row graph."""

    def use_gathered(self, on: bool) -> None:
        """Run steps in the gathered form (``on``, where ``can_gather``) or the backend's usual form."""

    def graphs(self, split: bool, gathered: bool = False) -> tuple[GraphEntry, ...]:
        """The graphs a step plan with or without ``split`` (or ``gathered``) runs (their hashes key the exactness
        verdict)."""
        return (self.manifest.base_graph("trt"),)

    def forget_buffers(self) -> None:
        """Drop whatever the backend keeps bound to cache buffers (before those buffers are freed or
        replaced by others of the same shape, as continuous batching does when rows join or leave)."""

    def release_unused(self) -> None:
        """Free what the resolved step plan does not run (the 1-row graph of a non-split plan)."""

    def make_drafter(self, name: str, bundle_dir: Path, manifest: BundleManifest, tree: str | None,
                     chains: bool) -> Drafter | None:
        """A trained draft ``name`` that runs where this backend runs (its device), or None: the runtime's
        own drafter, in ONNX Runtime on the CPU."""
        return None

    def runtime_version(self) -> str:
        """The kernel library's name and version, part of the exactness verdict's key."""
        return self.name

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
