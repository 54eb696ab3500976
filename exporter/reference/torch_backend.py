"""The torch reference backend: ``graphs/base_step.BaseStep`` in PyTorch, eager or replayed from CUDA graphs.

It runs wherever PyTorch does: eager on the CPU (CI compares it with ONNX Runtime there) and on CUDA,
where decode steps are captured with ``torch.cuda.CUDAGraph`` per (batch, capacity bucket, padded T)
following :mod:`specdeploy.runtime.capture`: warm up on a side stream, capture, then replay with the
inputs copied into fixed buffers. The cache buffers come from a per-shape pool, so the addresses baked
into a graph stay valid across generations.

It lives in the exporter because the runtime never imports torch. It joins the runtime's backend registry
as three plugins declared in ``pyproject.toml`` (entry points ``specdeploy.backends``): ``torch`` (CUDA
graphs when CUDA is present), ``torch-eager`` and ``torch-graphs``.

``BaseStep`` writes the cache out of place (that is what exports to a scatter), so each step copies its
T new rows back into the cache buffers in place; in a graph that copy is captured with the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from specdeploy.graphs.base_step import BaseStep
from specdeploy.runtime.backends import Backend, StepInputs, StepOutputs
from specdeploy.runtime.bundle import BundleManifest
from specdeploy.runtime.capture import CaptureKey, prepare_captured_step, tree_buckets
from specdeploy.runtime.errors import BackendUnavailableError, DraftMismatchError
from specdeploy.runtime.kvcache import KVCache, capacity_buckets

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    static: dict[str, torch.Tensor]  # fixed input buffers
    logits: torch.Tensor  # [B, T_pad, V] output of the graph
    hidden: torch.Tensor  # [B, T_pad, H]
    cache_ptrs: tuple[int, ...]


class TorchBackend(Backend):
    """Runs BaseStep on ``device`` in ``precision``; ``cuda_graphs`` replays decode steps from graphs."""

    def __init__(self, bundle_dir: str | Path, manifest: BundleManifest, device: str | None = None,
                 precision: str = "fp32", cuda_graphs: bool | None = None, model: str | None = None,
                 threads: int | None = None):
        from specdeploy.exporter.source import load_model

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BackendUnavailableError("The torch backend was asked for CUDA, but PyTorch sees no CUDA GPU.")
        if cuda_graphs is None:
            cuda_graphs = device.startswith("cuda")
        if cuda_graphs and not device.startswith("cuda"):
            raise BackendUnavailableError("CUDA graphs need a CUDA GPU; use the 'torch-eager' backend on a CPU.")
        if precision not in DTYPES:
            raise BackendUnavailableError(f"Unknown precision '{precision}'; choose one of {', '.join(DTYPES)}.")
        if manifest.kv_form != "inplace":
            raise BackendUnavailableError(f"The torch backend runs in-place KV bundles, not kv_form '{manifest.kv_form}'.")
        if threads and device == "cpu":
            torch.set_num_threads(threads)
        self.bundle_dir, self.manifest = Path(bundle_dir), manifest
        self.device, self.dtype, self.cuda_graphs = torch.device(device), DTYPES[precision], cuda_graphs
        self.name = f"torch-{device.split(':')[0]}-{precision}" + ("-graphs" if cuda_graphs else "")
        loaded = load_model(model or manifest.source.path)
        if loaded.weight_sha != manifest.source.weight_sha:
            raise DraftMismatchError(
                f"The model at '{loaded.path}' is not the one this bundle was exported from (weight hash differs)."
            )
        self.step_module = BaseStep(loaded.model).to(self.device, self.dtype).eval()
        limits = manifest.limits
        self.t_buckets = tree_buckets(limits.max_tree)
        self.cap_buckets = capacity_buckets(limits.max_context, limits.max_tree)
        self._pool: dict[tuple[int, ...], list[torch.Tensor]] = {}  # shape -> cache buffers, reused
        self._graphs: dict[CaptureKey, _Captured] = {}
        self._mempool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self._neg = torch.finfo(self.dtype).min

    # --- cache -------------------------------------------------------------------------------------
    def _allocator(self):
        counts: dict[tuple[int, ...], int] = {}

        def allocate(shape: tuple[int, ...]) -> torch.Tensor:
            shape = tuple(int(s) for s in shape)
            if not self.cuda_graphs:
                return torch.zeros(shape, dtype=self.dtype, device=self.device)
            k = counts.get(shape, 0)
            counts[shape] = k + 1
            bufs = self._pool.setdefault(shape, [])
            if k == len(bufs):
                bufs.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            return bufs[k].zero_()

        return allocate

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        m = self.manifest.model
        return KVCache.allocate_for(m.num_layers, m.num_kv_heads, m.head_dim, batch, capacity, self._allocator())

    # --- the step ----------------------------------------------------------------------------------
    def _forward(self, ids, pos, mask, widx, lidx, past: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """BaseStep, then its T new K/V rows written back into the cache buffers (in place)."""
        logits, hidden, *presents = self.step_module(ids, pos, mask, widx, lidx, past)
        for buf, new in zip(past, presents):
            buf.index_copy_(2, widx, new.index_select(2, widx))
        return logits, hidden

    def _to_device(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        dev = self.device
        mask = torch.from_numpy(inputs.attention_mask).to(dev)
        # float32's min overflows to -inf in fp16/bf16; clamp so a row never sums to NaN.
        mask = mask.clamp(min=self._neg).to(self.dtype)
        return {
            "ids": torch.from_numpy(inputs.input_ids).to(dev),
            "pos": torch.from_numpy(inputs.position_ids).to(dev),
            "mask": mask,
            "widx": torch.from_numpy(inputs.write_indices).to(dev),
            "lidx": torch.from_numpy(inputs.logits_index).to(dev),
        }

    @staticmethod
    def _host(x: torch.Tensor) -> np.ndarray:
        return x.float().cpu().numpy()  # numpy has no bf16

    def step(self, inputs: StepInputs, cache: KVCache) -> StepOutputs:
        with torch.no_grad():
            padded = (prepare_captured_step(inputs, cache, self.t_buckets, self.cap_buckets)
                      if self.cuda_graphs else None)
            if padded is None:
                t = self._to_device(inputs)
                logits, hidden = self._forward(t["ids"], t["pos"], t["mask"], t["widx"], t["lidx"], cache.buffers())
                return StepOutputs(self._host(logits), self._host(hidden))
            cap = self._graph_for(padded.key, padded.inputs, cache)
            for name, value in self._to_device(padded.inputs).items():
                cap.static[name].copy_(value)
            cap.graph.replay()
            # Only the real rows go back to the host.
            return StepOutputs(self._host(cap.logits[:, : padded.k_real]),
                               self._host(cap.hidden[:, : padded.n_real]))

    def _graph_for(self, key: CaptureKey, feed: StepInputs, cache: KVCache) -> _Captured:
        bufs = cache.buffers()
        ptrs = tuple(b.data_ptr() for b in bufs)
        cap = self._graphs.get(key)
        if cap is not None and cap.cache_ptrs == ptrs:
            return cap
        static = {k: v.clone() for k, v in self._to_device(feed).items()}
        args = (static["ids"], static["pos"], static["mask"], static["widx"], static["lidx"], bufs)
        # Warm-up on a side stream (lazy inits, autotuning) before capture, as PyTorch recommends.
        # The step is idempotent for fixed inputs: it rewrites the same rows with the same values.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits, hidden = self._forward(*args)
        cap = self._graphs[key] = _Captured(graph, static, logits, hidden, ptrs)
        return cap

    def close(self) -> None:
        self._graphs.clear()
        self._pool.clear()


def make_torch(bundle_dir: Path, manifest: BundleManifest, threads: int | None = None) -> TorchBackend:
    """``torch``: CUDA graphs when CUDA is present, eager on the CPU."""
    return TorchBackend(bundle_dir, manifest, cuda_graphs=None, threads=threads)


def make_torch_eager(bundle_dir: Path, manifest: BundleManifest, threads: int | None = None) -> TorchBackend:
    return TorchBackend(bundle_dir, manifest, cuda_graphs=False, threads=threads)


def make_torch_graphs(bundle_dir: Path, manifest: BundleManifest, threads: int | None = None) -> TorchBackend:
    return TorchBackend(bundle_dir, manifest, cuda_graphs=True, threads=threads)
