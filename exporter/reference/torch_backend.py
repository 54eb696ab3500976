"""The torch reference backend: ``graphs/base_step.BaseStep`` in PyTorch, eager or replayed from CUDA graphs.

It runs wherever PyTorch does: eager on the CPU (CI compares it with ONNX Runtime there) and on CUDA,
where decode steps are captured with ``torch.cuda.CUDAGraph`` per (batch, capacity bucket, padded T)
following :mod:`specdeploy.runtime.capture`: warm up on a side stream, capture, then replay with the
inputs copied into fixed buffers. The cache buffers come from a per-shape pool, so the addresses baked
into a graph stay valid across generations. :meth:`TorchBackend.capture_all` captures every graph a
decode can replay up front, so that no capture happens inside timed decoding.

The step is rebuilt from the bundle's own weights (its fp32 ``ort`` graph, read with ``onnx``; see
``graphs/native_step.py``): no transformers and no source model at decode time. Norms run in fp32 in
every precision, logits come back as fp32, the new K/V rows are written into the cache buffers in
place, and attention is ``scaled_dot_product_attention``. ``weights``/``shape`` replace the bundle's
weights (random ones of the real architecture, for timings: see ``scripts/gpu_check.sh``).

It lives in the exporter because the runtime never imports torch. It joins the runtime's backend registry
as three plugins declared in ``pyproject.toml`` (entry points ``specdeploy.backends``): ``torch`` (CUDA
graphs when CUDA is present), ``torch-eager`` and ``torch-graphs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from specdeploy.graphs.native_step import StepShape, step_from_weights
from specdeploy.runtime.backends import Backend, StepInputs, StepOutputs
from specdeploy.runtime.bundle import BundleManifest, graph_paths
from specdeploy.runtime.capture import CaptureKey, chain_feed, prepare_captured_step, tree_buckets
from specdeploy.runtime.errors import BackendUnavailableError, BundleError
from specdeploy.runtime.kvcache import KVCache, capacity_buckets
from specdeploy.runtime.precision import FP32

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    static: dict[str, torch.Tensor]  # fixed input buffers
    logits: torch.Tensor  # [B, T_pad, V] fp32 output of the graph
    argmax: torch.Tensor  # [B, T_pad] int64
    hidden: torch.Tensor  # [B, T_pad, H]
    cache_ptrs: tuple[int, ...]
    layers: torch.Tensor | None = None  # [B, T_pad, taps*H] with feature_layers


class TorchBackend(Backend):
    """Runs BaseStep on ``device`` in ``precision``; ``cuda_graphs`` replays decode steps from graphs."""

    def __init__(self, bundle_dir: str | Path, manifest: BundleManifest, device: str | None = None,
                 precision: str = "fp32", cuda_graphs: bool | None = None, threads: int | None = None,
                 weights: dict[str, torch.Tensor] | None = None, shape: StepShape | None = None,
                 feature_layers: tuple[int, ...] = ()):
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
        if weights is None:  # the bundle's own: with the taps its graph has, which its Chimera reads
            weights, shape = bundle_weights(self.bundle_dir, manifest)
            feature_layers = feature_layers or manifest.find_graph("base", "ort", FP32).feature_layers
        elif shape is None:
            raise ValueError("weights need their shape")
        try:
            step = step_from_weights(weights, shape, feature_layers)
        except (KeyError, ValueError) as exc:
            raise BundleError(f"The bundle's weights do not fit its model: {exc}.") from None
        step.inplace_kv, step.sdpa = True, True
        self.step_module = step.to(self.device, self.dtype).eval()
        limits = manifest.limits
        self.t_buckets = tree_buckets(limits.max_tree)
        self.cap_buckets = capacity_buckets(limits.max_context, limits.max_tree)
        self._pool: dict[tuple[int, ...], list[torch.Tensor]] = {}  # shape -> cache buffers, reused
        self._graphs: dict[CaptureKey, _Captured] = {}
        self._mempool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self._neg = torch.finfo(self.dtype).min
        self.captures = 0  # graphs captured so far (capture_all does them all before timing)

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
    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The decoder layers whose residual outputs each step returns (``layer_states``)."""
        return self.step_module.feature_layers

    @property
    def layer_states(self) -> bool:  # what a fusing draft (EAGLE-3 taps) needs from every step
        return bool(self.step_module.feature_layers)

    def _forward(self, ids, pos, mask, widx, lidx, past: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """BaseStep with the cache written in place; fp32 logits, each row's argmax, the hidden states and the
        tapped layers' states (None without feature_layers)."""
        out = self.step_module(ids, pos, mask, widx, lidx, past)
        logits = out[0].float()
        return logits, logits.argmax(-1), out[1], out[2] if self.step_module.feature_layers else None

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

    def _outputs(self, logits: torch.Tensor, argmax: torch.Tensor, hidden: torch.Tensor,
                 layers: torch.Tensor | None = None) -> StepOutputs:
        """Hidden states (and tapped layers) and argmax to the host now; logits stay on the device until a row
        is read."""
        taps = None if layers is None else layers.float().cpu().numpy()
        return StepOutputs(DeviceRows(logits), hidden.float().cpu().numpy(), taps, argmax=argmax.cpu().numpy())

    def step(self, inputs: StepInputs, cache: KVCache) -> StepOutputs:
        with torch.no_grad():
            padded = (prepare_captured_step(inputs, cache, self.t_buckets, self.cap_buckets)
                      if self.cuda_graphs else None)
            if padded is None:
                t = self._to_device(inputs)
                return self._outputs(*self._forward(t["ids"], t["pos"], t["mask"], t["widx"], t["lidx"],
                                                    cache.buffers()))
            cap = self._graph_for(padded.key, padded.inputs, cache)
            for name, value in self._to_device(padded.inputs).items():
                cap.static[name].copy_(value)
            cap.graph.replay()
            # Only the real rows; the logits are copied on the device, since the next replay rewrites them.
            k, n = padded.k_real, padded.n_real
            return self._outputs(cap.logits[:, :k].clone(), cap.argmax[:, :k], cap.hidden[:, :n],
                                 None if cap.layers is None else cap.layers[:, :n])

    def capture_all(self) -> int:
        """Capture every graph a one-row decode can replay (each capacity bucket x padded T), so that no
        capture happens inside timed decoding. Returns how many graphs were captured."""
        if not self.cuda_graphs:
            return 0
        before = self.captures
        for capacity in self.cap_buckets:
            cache = self.new_cache(1, capacity)  # the pooled buffers a decode of this capacity gets
            for t in (t for t in self.t_buckets if 1 + t <= capacity):
                feed = chain_feed(np.zeros(t, np.int64), 1, capacity, np.arange(t))  # after one committed slot
                with torch.no_grad():
                    self._graph_for(CaptureKey(1, capacity, t), feed, cache)
        return self.captures - before

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
            logits, argmax, hidden, layers = self._forward(*args)
        self.captures += 1
        cap = self._graphs[key] = _Captured(graph, static, logits, argmax, hidden, ptrs, layers)
        return cap

    can_gather = True  # BaseStep.gathered: each row's keys in plain-step order (exact trees by construction)

    def use_gathered(self, on: bool) -> None:
        if self.step_module.gathered != on:
            self.step_module.gathered = on
            self._graphs.clear()  # captured in the other form

    def make_drafter(self, name: str, bundle_dir: Path, manifest: BundleManifest, tree: str | None, chains: bool):
        """Trained drafts run here too, in torch on this device (``torch_drafters.py``)."""
        from specdeploy.exporter.reference.torch_drafters import bundle_drafter

        step = self.step_module
        return bundle_drafter(name, manifest, step.embed_tokens.weight, step.lm_head.weight, self.device, self.dtype,
                              tree, chains)

    def close(self) -> None:
        self._graphs.clear()
        self._pool.clear()


def bundle_weights(bundle_dir: Path, manifest: BundleManifest) -> tuple[dict[str, torch.Tensor], StepShape]:
    """The base step's weights from the bundle's fp32 ``ort`` graph, and the shape they have."""
    import onnx
    from onnx import numpy_helper

    entry = manifest.find_graph("base", "ort", FP32)
    if entry is None:
        have = ", ".join(f"{g.target}/{g.precision}" for g in manifest.graphs if g.role == "base")
        raise BackendUnavailableError(
            f"The torch backend reads the base weights from the bundle's fp32 'ort' graph, which this bundle "
            f"lacks (it has: {have}); export one with 'specdeploy export base --precision fp32'.")
    for path in graph_paths(bundle_dir, entry):
        if not path.is_file():
            raise BundleError(f"The bundle is incomplete: '{path.name}' is listed in the manifest but missing.")
    proto = onnx.load(str(bundle_dir / entry.file))  # external data from the bundle's files, shared ones too
    wanted = {"embed_tokens", "lm_head_t", "final_norm", "rotary_cos", "rotary_sin"}
    weights = {init.name: torch.from_numpy(numpy_helper.to_array(init).copy()) for init in proto.graph.initializer
               if init.name in wanted or init.name.startswith("layers.")}
    eps = next((a.f for n in proto.graph.node if n.op_type.endswith("SimplifiedLayerNormalization")
                for a in n.attribute if a.name == "epsilon"), None)
    m = manifest.model
    if eps is None or "layers.0.down_t" not in weights:
        raise BundleError(f"The bundle's graph '{entry.file}' is not a specdeploy base graph; re-export the bundle.")
    shape = StepShape(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                      intermediate_size=int(weights["layers.0.down_t"].shape[0]), num_layers=m.num_layers,
                      num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, rms_norm_eps=eps,
                      max_positions=int(weights["rotary_cos"].shape[0]),
                      qkv_bias="layers.0.qkv_bias" in weights)
    return weights, shape


class DeviceRows(np.lib.mixins.NDArrayOperatorsMixin):
    """A read-only array on the device that copies to the host only what is read.

    Indexing that keeps two or more axes gives another ``DeviceRows``; indexing down to a row copies that
    row. Anything else (numpy functions, operators, methods) copies the whole array once and works on it.
    Greedy decoding then reads back only the rows it needs (often none: the backend gives each row's argmax).
    """

    def __init__(self, tensor: torch.Tensor):
        self._t = tensor
        self._host: np.ndarray | None = None

    shape = property(lambda self: tuple(self._t.shape))
    ndim = property(lambda self: self._t.dim())
    dtype = property(lambda self: np.dtype(np.float32))

    def __len__(self) -> int:
        return len(self._t)

    def __getitem__(self, index: Any) -> Any:
        if self._host is not None:
            return self._host[index]
        parts = index if isinstance(index, tuple) else (index,)
        parts = tuple(torch.as_tensor(p, device=self._t.device) if isinstance(p, np.ndarray) else p for p in parts)
        out = self._t[parts]
        return DeviceRows(out) if out.dim() >= 2 else out.cpu().numpy()

    def top_row(self, index: int, k: int) -> np.ndarray:
        """Row ``index`` (of a 2-D array) with -inf outside its ``k`` largest entries, reading back only those;
        the whole row where the k-th largest ties the next (top-k sampling keeps every tie)."""
        row = self._t[index]
        if self._host is not None or k + 1 >= row.shape[-1]:
            return np.asarray(self)[index]
        vals, ids = torch.topk(row, k + 1)  # descending
        vals, ids = vals.cpu().numpy(), ids.cpu().numpy()
        if vals[k] == vals[k - 1]:
            return row.cpu().numpy()
        out = np.full(row.shape[-1], -np.inf, dtype=np.float32)
        out[ids[:k]] = vals[:k]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._host is None:
            self._host = self._t.cpu().numpy()
        return self._host if dtype is None else self._host.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(np.asarray(x) if isinstance(x, DeviceRows) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        args = tuple(np.asarray(x) if isinstance(x, DeviceRows) else x for x in args)
        return func(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # ndarray methods (astype, max, ...) on the host copy
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(np.asarray(self), name)


def make_torch(bundle_dir: Path, manifest: BundleManifest, threads: int | None = None) -> TorchBackend:
    """``torch``: CUDA graphs when CUDA is present (all captured at load), eager on the CPU."""
    backend = TorchBackend(bundle_dir, manifest, cuda_graphs=None, threads=threads)
    backend.capture_all()
    return backend


def make_torch_eager(bundle_dir: Path, manifest: BundleManifest, threads: int | None = None) -> TorchBackend:
    return TorchBackend(bundle_dir, manifest, cuda_graphs=False, threads=threads)


def make_torch_graphs(bundle_dir: Path, manifest: BundleManifest, threads: int | None = None) -> TorchBackend:
    """``torch-graphs``: every decode graph captured at load, so that none is captured while generating."""
    backend = TorchBackend(bundle_dir, manifest, cuda_graphs=True, threads=threads)
    backend.capture_all()
    return backend
