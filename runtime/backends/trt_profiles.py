"""TensorRT optimization profiles and engine selection: pure functions of the bundle's limits and the device (no TensorRT needed)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..bundle import EngineEntry, Limits, TensorSpec
from ..errors import BackendUnavailableError, BundleError
from ..kvcache import bucket_for, capacity_buckets
from ..precision import BF16, FP16, FP32

# Which engine a backend loads when the bundle has several precisions for this GPU.
PRECISION_PREFERENCE = (FP16, BF16, FP32)


PREFILL_OPT_T = 256  # the prompt length prefill kernels are tuned for (a typical chat turn)


@dataclass(frozen=True)
class DimRange:
    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"need 1 <= min <= opt <= max, got {self.min}/{self.opt}/{self.max}")

    def __contains__(self, value: int) -> bool:
        return self.min <= value <= self.max


@dataclass(frozen=True)
class Profile:
    """Ranges of the graph's dynamic dimensions for one TensorRT optimization profile.

    ``capacity`` is the cache length C (committed past + this step's rows), ``tree`` is T and ``kept``
    is the number of logits rows K.
    """

    name: str  # "prefill" | "tree"
    batch: DimRange
    tree: DimRange
    capacity: DimRange
    kept: DimRange

    def dim(self, symbol: str) -> DimRange:
        ranges = {"batch": self.batch, "tree": self.tree, "capacity": self.capacity, "kept": self.kept}
        if symbol not in ranges:
            raise BundleError(
                f"The graph has a dynamic dimension '{symbol}' that TensorRT profiles do not know how to bound "
                f"(known: {', '.join(ranges)})."
            )
        return ranges[symbol]

    def shapes(self, spec: TensorSpec) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) shapes of one graph input; fixed dimensions stay as they are."""
        dims = [(d, d, d) if isinstance(d, int) else (self.dim(d).min, self.dim(d).opt, self.dim(d).max)
                for d in spec.shape]
        return tuple(tuple(d[i] for d in dims) for i in range(3))  # type: ignore[return-value]

    def contains(self, batch: int, tree: int, capacity: int, kept: int) -> bool:
        return batch in self.batch and tree in self.tree and capacity in self.capacity and kept in self.kept


def optimization_profiles(limits: Limits, max_tree: int | None = None, max_context: int | None = None,
                          max_batch: int | None = None) -> list[Profile]:
    """The prefill and tree-decoding profiles for a build; ``None`` means the bundle's limit.

    * prefill: T from 1 to ``max_context`` (tuned for a ``PREFILL_OPT_T``-token prompt), K from 1
      (the decoder keeps only the last row) to T;
    * tree: T from 1 to ``max_tree`` (tuned for a full tree), K = up to T;
    * both: capacity over the whole bucket range ``capacity_buckets(max_context, max_tree)`` (tuned for
      the middle bucket, the prefill for the bucket its prompt lands in) and batch 1..``max_batch``
      (tuned for 1, the single-stream case).
    """
    tree = limits.max_tree if max_tree is None else max_tree
    ctx = limits.max_context if max_context is None else max_context
    batch = limits.max_batch if max_batch is None else max_batch
    for flag, value, limit in (("--max-tree", tree, limits.max_tree), ("--max-context", ctx, limits.max_context),
                               ("--max-batch", batch, limits.max_batch)):
        if value < 1:
            raise BundleError(f"{flag} must be at least 1; got {value}.")
        if value > limit:
            raise BundleError(f"{flag} {value} exceeds the bundle's limit of {limit}; re-export with a larger limit.")
    buckets = capacity_buckets(ctx, tree)
    cap_mid = buckets[len(buckets) // 2]
    b = DimRange(1, 1, batch)
    pre_t = DimRange(1, min(PREFILL_OPT_T, ctx), ctx)
    prefill = Profile("prefill", b, pre_t, DimRange(buckets[0], bucket_for(pre_t.opt + tree, buckets), buckets[-1]),
                      DimRange(1, 1, ctx))
    tree_p = Profile("tree", b, DimRange(1, tree, tree), DimRange(buckets[0], cap_mid, buckets[-1]),
                     DimRange(1, tree, tree))
    return [prefill, tree_p]


def pick_profile(profiles: Sequence[Profile], batch: int, tree: int, capacity: int, kept: int) -> int:
    """Index of the profile a step runs under: the tree profile when it fits (it is tuned for decode)."""
    order = sorted(range(len(profiles)), key=lambda i: profiles[i].name != "tree")
    for i in order:
        if profiles[i].contains(batch, tree, capacity, kept):
            return i
    raise BackendUnavailableError(
        f"No TensorRT optimization profile covers batch {batch}, T {tree}, capacity {capacity}, K {kept}; "
        "rebuild the engines with larger --max-* limits."
    )


@dataclass(frozen=True)
class DeviceInfo:
    """The GPU and TensorRT version an engine is built for (engines are valid for exactly these)."""

    gpu: str  # e.g. "NVIDIA H200"
    compute_capability: str  # e.g. "9.0"
    trt_version: str  # e.g. "10.15.1.29"

    def describe(self) -> str:
        return f"{self.gpu} (compute {self.compute_capability}) with TensorRT {self.trt_version}"


def engine_dir_name(device: DeviceInfo) -> str:
    """``engines/<gpu-name>-<compute-capability>-trt<version>``, e.g. ``nvidia-h200-sm90-trt10.15.1.29``."""
    gpu = re.sub(r"[^a-z0-9]+", "-", device.gpu.lower()).strip("-") or "gpu"
    cc = "sm" + device.compute_capability.replace(".", "")
    return f"{gpu}-{cc}-trt{device.trt_version}"


def engine_file(device: DeviceInfo, graph: str, precision: str) -> str:
    """An engine's path relative to the bundle."""
    return f"engines/{engine_dir_name(device)}/{graph}-{precision}.plan"


def _same_device(e: EngineEntry, device: DeviceInfo) -> bool:
    return (e.gpu, e.compute_capability, e.trt_version) == (device.gpu, device.compute_capability, device.trt_version)


def select_engine(engines: Sequence[EngineEntry], graph: str, device: DeviceInfo,
                  precision: str | None = None) -> EngineEntry:
    """The engine this machine may load for ``graph``, or one clear sentence saying why there is none."""
    mine = [e for e in engines if e.graph == graph]
    if not mine:
        raise BundleError(
            f"The bundle has no TensorRT engine for its '{graph}' graph; build one with 'specdeploy build BUNDLE'."
        )
    here = [e for e in mine if _same_device(e, device)]
    if not here:
        other = mine[0]
        raise BundleError(
            f"The bundle's TensorRT engines were built for {other.gpu} (compute {other.compute_capability}) with "
            f"TensorRT {other.trt_version}, but this machine has {device.describe()}; rebuild them here with "
            "'specdeploy build BUNDLE'."
        )
    if precision is not None:
        for e in here:
            if e.precision == precision:
                return e
        raise BundleError(
            f"The bundle has no {precision} TensorRT engine for this GPU (it has: "
            f"{', '.join(sorted(e.precision for e in here))}); build one with "
            f"'specdeploy build BUNDLE --precision {precision}'."
        )
    rank = {p: i for i, p in enumerate(PRECISION_PREFERENCE)}
    return min(here, key=lambda e: rank.get(e.precision, len(rank)))
