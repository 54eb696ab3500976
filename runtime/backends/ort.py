"""ONNX Runtime backend: CPU EP here; CUDA and TensorRT EPs selectable by name.

The cache buffers are bound with IOBinding both as ``past_*`` inputs and as the ``present_*``
outputs, so the graph's scatter writes the new rows straight into the preallocated cache: no
per-step copy of the cache happens outside the graph (an experiment here measured aliasing as
bit-identical and ~4% faster than alternating two buffers).

:class:`OrtCudaBackend` (``ort-cuda``, ``ort-trt``; on the CPU machines this project develops on only its
control flow is tested, over stand-ins for ONNX Runtime and the CUDA runtime) keeps the cache and every
input/output in fixed device buffers bound by raw pointer. With ``enable_cuda_graph`` ONNX Runtime
captures one CUDA graph per ``gpu_graph_id``; we give each (batch, capacity bucket, padded T) its own
binding and id, following :mod:`specdeploy.runtime.capture`. The TensorRT EP gets an engine cache, a
timing cache and explicit profile shapes (the same prefill and tree profiles as ``specdeploy build``).
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..bundle import BundleManifest, GraphEntry
from ..contract import (
    ATTENTION_MASK,
    HIDDEN_STATES,
    INPUT_NAMES,
    LAYER_STATES,
    LOGITS,
    past_names,
    present_names,
)
from ..errors import BackendUnavailableError, BundleError
from ..kvcache import KVCache, zeroed
from ..precision import ENGINE_PRECISIONS, FP32
from .base import Backend, StepInputs, StepOutputs

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}


def default_threads() -> int:
    env = os.environ.get("SPECDEPLOY_THREADS")
    if env:
        return max(1, int(env))
    return max(1, os.cpu_count() or 1)


def make_session(path: Path, provider: str = "cpu", threads: int | None = None, provider_options: dict | None = None,
                 spin: bool = True):
    """An InferenceSession on the named execution provider, with one clear error when it is absent.

    ``spin`` False stops the intra-op threads from busy-waiting after a run (see :func:`make_draft_session`).
    """
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise BackendUnavailableError(f"Unknown ONNX Runtime provider '{provider}'; choose one of {', '.join(PROVIDERS)}.")
    ep = PROVIDERS[provider]
    if ep not in ort.get_available_providers():
        extra = "onnxruntime-gpu (pip install 'specdeploy[gpu]')" if provider != "cpu" else "onnxruntime"
        raise BackendUnavailableError(
            f"ONNX Runtime's {ep} is not available on this machine; it needs a GPU and {extra}."
        )
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or default_threads()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers: list[Any] = [(ep, provider_options or {})]
    if ep != "CPUExecutionProvider":
        providers.append("CPUExecutionProvider")
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

    load_errors = (ort_errors.Fail, ort_errors.InvalidGraph, ort_errors.InvalidProtobuf, ort_errors.NoSuchFile,
                   ort_errors.InvalidArgument, ort_errors.NotImplemented, ort_errors.RuntimeException)
    try:
        return ort.InferenceSession(str(path), sess_options=so, providers=providers)
    except load_errors as exc:
        raise BundleError(f"ONNX Runtime cannot load '{path.name}' ({str(exc).splitlines()[0][:200]}).") from None


def make_draft_session(path: Path):
    """A CPU session for a draft graph: one intra-op thread (the caller's), no spinning.

    A draft graph runs between base steps on the same cores. Measured on 2 cores with the Chimera
    draft: with its own 2-thread pool, each session's threads busy-wait after a run and steal the
    cores from the other session (base tree step 84 ms instead of 43, draft 16 ms instead of 9;
    Chimera at 0.56x plain decoding instead of 0.80x). The draft graphs are small enough that one
    thread loses little.
    """
    return make_session(path, "cpu", threads=1, spin=False)


class OrtBackend(Backend):
    """Runs the bundle's base step graph with ONNX Runtime."""

    def __init__(self, bundle_dir: str | Path, manifest: BundleManifest, provider: str = "cpu",
                 threads: int | None = None, graph: GraphEntry | None = None, provider_options: dict | None = None):
        self.bundle_dir = Path(bundle_dir)
        self.manifest = manifest
        self.provider = provider
        self.name = f"ort-{provider}"
        self.threads = threads or default_threads()
        one_row, own_choice = None, graph is None and provider == "cpu"
        if own_choice:
            # Two graphs when the bundle has a GGUF-block graph (BundleManifest.cpu_base): 1-row steps may
            # run it, steps of more rows the fused graph; both bind the same cache. Whether 1-row steps do
            # is the step plan's choice (``use_split``), made by measurement (runtime/plan.py).
            graph, one_row = manifest.cpu_base(multi_row=True), manifest.cpu_base(multi_row=False)
            one_row = None if one_row.file == graph.file else one_row
        # The exact-tree graph (``BundleManifest.tree_graph``: each row's keys in plain-step order), which the
        # ``gathered`` step plans run for every step of at most ``max_tree`` rows (``use_gathered``).
        self.tree_graph = manifest.tree_graph() if own_choice else None
        self.can_gather = self.tree_graph is not None
        self.can_batch_rows = self.can_gather and self.tree_graph.rows_apart
        self._gathered = False
        entry = graph or manifest.base_graph("trt")
        self.graph, self.one_row_graph = entry, one_row  # the graphs this backend runs
        self.can_split = one_row is not None
        self.layer_states = bool(entry.feature_layers) and (one_row is None or bool(one_row.feature_layers))
        self._provider_options = provider_options
        # Sessions are made on first use (``_session``), so that a step plan resolved from the verdict
        # cache never loads the graph it does not run.
        self._sessions: dict[str, tuple[Any, bool]] = {}  # "base" | "one_row" -> (session, spinning)
        self._split = False
        self.graph_steps: Counter[str] = Counter()  # steps run per graph ("base", "one_row", "tree")
        m = manifest.model
        self._past, self._present = past_names(m.num_layers), present_names(m.num_layers)
        dtype = next(s.dtype for s in entry.inputs if s.name == self._past[0])
        self._kv_dtype = np.dtype(dtype)
        self._out_dtype = {s.name: np.dtype(s.dtype) for s in entry.outputs}
        self._mask_dtype = np.dtype(next(s.dtype for s in entry.inputs if s.name == ATTENTION_MASK))
        self._ortvalues: dict[int, Any] = {}  # id(buffer) -> OrtValue sharing its memory
        self._bindings: dict[int, tuple[KVCache, int, Any]] = {}  # id(session) -> (cache, epoch, binding)

    @property
    def mask_dtype(self) -> np.dtype:
        return self._mask_dtype

    def _session(self, which: str):
        """The base (or 1-row) graph's session. Two base sessions alternating on the same cores must not
        keep their threads spinning after a run (the thread fight measured in make_draft_session); one
        alone should: with spinning off, plain decoding on the fp32 bundle ran at 0.85x (39.0 against
        46.1 tok/s, one bench run on the AMD EPYC)."""
        held = self._sessions.get(which)
        if held is None:
            entry = {"base": self.graph, "one_row": self.one_row_graph, "tree": self.tree_graph}[which]
            spin = not self._split
            held = self._sessions[which] = (make_session(self.bundle_dir / entry.file, self.provider, self.threads,
                                                         self._provider_options, spin=spin), spin)
        return held[0]

    @property
    def session(self):
        return self._session("base")

    @property
    def one_row_session(self):
        return self._session("one_row") if self.can_split else None

    def use_split(self, on: bool) -> None:
        self._split = on and self.can_split

    def use_gathered(self, on: bool) -> None:
        self._gathered = on and self.can_gather

    def graphs(self, split: bool, gathered: bool = False) -> tuple[GraphEntry, ...]:
        if gathered and self.can_gather:
            return (self.graph, self.tree_graph)
        return (self.graph, self.one_row_graph) if split and self.can_split else (self.graph,)

    def runtime_version(self) -> str:
        import onnxruntime as ort

        return f"onnxruntime {ort.__version__} {self.provider}"

    def release_unused(self) -> None:
        """Settle the sessions on the step plan: without ``split``, free the 1-row graph's session and
        make sure the base session spins (it was made without spinning if a split plan was probed)."""
        if not self._split and self.can_split:
            self.can_split = False
            self._sessions.pop("one_row", None)
            if not self._sessions.get("base", (None, True))[1]:
                del self._sessions["base"]
            self._bindings.clear()
        if not self._gathered and self.can_gather:
            self.can_gather = self.can_batch_rows = False
            self._sessions.pop("tree", None)
            self._bindings.clear()
        self._session("base")  # loaded now: a graph ONNX Runtime cannot load fails at load, not mid-stream
        if self._gathered:
            self._session("tree")

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        m = self.manifest.model

        def alloc(s: tuple[int, ...]) -> np.ndarray:
            return zeroed(s, self._kv_dtype)

        return KVCache.allocate_for(m.num_layers, m.num_kv_heads, m.head_dim, batch, capacity, alloc)

    def _ortvalue(self, buf: np.ndarray):
        import onnxruntime as ort

        ov = self._ortvalues.get(id(buf))
        if ov is None or ov.shape() != list(buf.shape):
            ov = ort.OrtValue.ortvalue_from_numpy(buf)  # shares memory with the numpy buffer on CPU
            self._ortvalues[id(buf)] = ov
        return ov

    def _cache_binding(self, session, cache: KVCache):
        """The session's binding with the cache's K/V bound in place (present aliases past).

        The 2 x layers cache bindings are made once per cache buffer set and kept, so a step only
        rebinds its five small inputs and two outputs (about 0.3 ms of Python per step less). The
        entry holds the cache itself, so a freed cache's id cannot be mistaken for a new one's, and
        its epoch, which changes when the cache reallocates its buffers.
        """
        held = self._bindings.get(id(session))
        if held is not None and held[0] is cache and held[1] == cache.epoch:
            return held[2]
        buffers = cache.buffers()
        live = {id(b) for b in buffers}
        if len(self._ortvalues) > len(live):  # the cache was reallocated: drop stale views
            self._ortvalues = {k: v for k, v in self._ortvalues.items() if k in live}
        binding = session.io_binding()
        binding.bind_output(LOGITS)  # first, so they stay outputs 0 and 1 when a step rebinds them
        binding.bind_output(HIDDEN_STATES)
        for past, present, buf in zip(self._past, self._present, buffers):
            ov = self._ortvalue(buf)
            binding.bind_ortvalue_input(past, ov)
            binding.bind_ortvalue_output(present, ov)  # in place: present aliases past
        self._bindings[id(session)] = (cache, cache.epoch, binding)
        return binding

    def step(self, inputs: StepInputs, cache: KVCache) -> StepOutputs:
        rows = inputs.input_ids.shape[1]
        which, entry = "base", self.graph
        if self._split and rows == 1:
            which, entry = "one_row", self.one_row_graph
        elif self._gathered and rows <= self.manifest.limits.max_tree:
            # every step of a tree's size; a longer prefill on the fused graph (plain and speculative runs
            # prefill alike, so their caches stay equal)
            which, entry = "tree", self.tree_graph
        session = self._session(which)
        self.graph_steps[which] += 1
        binding = self._cache_binding(session, cache)
        for name in INPUT_NAMES:  # the StepInputs fields carry the contract's names
            binding.bind_cpu_input(name, getattr(inputs, name))
        # Fresh host arrays each step (earlier results stay valid), bound by pointer: ONNX Runtime writes
        # into them, so no output is copied and no wrapper is made for the 2 x layers cache outputs.
        b, t = inputs.input_ids.shape
        m = self.manifest.model
        logits = np.empty((b, len(inputs.logits_index), m.vocab_size), dtype=self._out_dtype[LOGITS])
        hidden = np.empty((b, t, m.hidden_size), dtype=self._out_dtype[HIDDEN_STATES])
        outputs = [(LOGITS, logits), (HIDDEN_STATES, hidden)]
        layers = None
        if entry.feature_layers:
            layers = np.empty((b, t, len(entry.feature_layers) * m.hidden_size), dtype=np.float32)
            outputs.append((LAYER_STATES, layers))
        for name, arr in outputs:
            binding.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        session.run_with_iobinding(binding)
        return StepOutputs(logits=logits, hidden_states=hidden, layer_states=layers)

    def forget_buffers(self) -> None:
        self._bindings.clear()
        self._ortvalues.clear()

    def close(self) -> None:
        self.forget_buffers()
        self._sessions.clear()


# --- GPU execution providers (UNTESTED here: needs a GPU with onnxruntime-gpu) ----------------------
def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def trt_ep_options(bundle_dir: Path, manifest: BundleManifest, precision: str = "fp32",
                   workspace_gb: float = 4.0) -> dict[str, str]:
    """TensorRT-EP provider options: engine and timing caches under ``bundle/engines/``, explicit profiles.

    Each input is listed once per profile (prefill, then tree), which is how the EP takes several
    optimization profiles.
    """
    from .trt_profiles import optimization_profiles

    profiles = optimization_profiles(manifest.limits)
    entry = manifest.base_graph("trt")
    shapes: dict[str, list[str]] = {"min": [], "opt": [], "max": []}
    for p in profiles:
        for spec in entry.inputs:
            lo, opt, hi = p.shapes(spec)
            shapes["min"].append(f"{spec.name}:{_dims(lo)}")
            shapes["opt"].append(f"{spec.name}:{_dims(opt)}")
            shapes["max"].append(f"{spec.name}:{_dims(hi)}")
    cache_dir = bundle_dir / "engines" / "ort-trt-ep"
    return {
        "device_id": "0",
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": "1",
        "trt_timing_cache_path": str(cache_dir),
        "trt_max_workspace_size": str(int(workspace_gb * (1 << 30))),
        "trt_fp16_enable": "1" if precision == "fp16" else "0",
        "trt_bf16_enable": "1" if precision == "bf16" else "0",
        "trt_profile_min_shapes": ",".join(shapes["min"]),
        "trt_profile_opt_shapes": ",".join(shapes["opt"]),
        "trt_profile_max_shapes": ",".join(shapes["max"]),
        "trt_cuda_graph_enable": "0",  # our own graph ids need the CUDA EP's capture; see OrtCudaBackend
    }


@dataclass
class _Binding:
    """One IOBinding over fixed device buffers; ``graph_id`` -1 runs uncaptured."""

    binding: Any
    inputs: dict[str, Any]  # name -> DeviceArray
    logits: Any
    hidden: Any
    graph_id: int
    past_ptrs: tuple[int, ...]

    def free(self) -> None:
        for buf in (*self.inputs.values(), self.logits, self.hidden):
            buf.free()


class OrtCudaBackend(OrtBackend):
    """ORT on the CUDA EP (``enable_cuda_graph``) or the TensorRT EP, with IOBinding over device buffers.

    Graph ids. ONNX Runtime keeps every graph it captured for the session's life (it has no call to free
    one id's graph) and replays the graph of an id it knows whatever is bound. So an id is never reused:
    a re-bind (the cache buffers of a key changed) or a binding made after :meth:`forget_buffers` takes a
    fresh id and captures a new graph, and the old id's graph stays in device memory, unused.
    """

    def __init__(self, bundle_dir: str | Path, manifest: BundleManifest, provider: str = "cuda",
                 threads: int | None = None, cuda_graphs: bool = True, precision: str = FP32):
        bundle_dir = Path(bundle_dir)
        if provider == "cuda":
            if precision != FP32:
                raise BackendUnavailableError(
                    f"The ort-cuda backend runs the bundle's fp32 graph only; for {precision} use the 'trt' backend "
                    f"(after 'specdeploy build --precision {precision}') or the 'torch' backend.")
            options = {"device_id": "0", "enable_cuda_graph": "1" if cuda_graphs else "0"}
        elif provider == "tensorrt":
            if precision not in ENGINE_PRECISIONS:
                raise BackendUnavailableError(
                    f"The ort-trt backend builds {', '.join(ENGINE_PRECISIONS)} engines, not '{precision}'.")
            options = trt_ep_options(bundle_dir, manifest, precision)
            cuda_graphs = False
        else:
            raise BackendUnavailableError(f"OrtCudaBackend runs the cuda or tensorrt provider, not '{provider}'.")
        super().__init__(bundle_dir, manifest, provider, threads, provider_options=options)
        # The CUDA EP computes in the graph's own precision; the TensorRT EP in the one asked for.
        self.precision = self.graph.precision if provider == "cuda" else precision
        self.name = f"ort-{provider}-{self.precision}"
        self.layer_states = False  # its device bindings carry logits and hidden states only
        self.cuda_graphs = cuda_graphs
        self._load()  # now: a missing provider or GPU is one sentence at load
        from ..capture import tree_buckets
        from .trt import CachePool, check, cudart

        self._check, self._rt = check, cudart()
        self.stream = check(self._rt.cudaStreamCreate())
        self.t_buckets = tree_buckets(manifest.limits.max_tree)
        self.cap_buckets = manifest.capacity_buckets
        self.pool = CachePool(self._kv_dtype, self.stream, ping_pong=False)  # present aliases past
        entry = manifest.base_graph("trt")
        self._out_dtype = {s.name: np.dtype(s.dtype) for s in entry.outputs}
        self._in_dtype = {s.name: np.dtype(s.dtype) for s in entry.inputs}
        self._bindings: dict[tuple[int, int, int], _Binding] = {}
        self._next_graph_id = 1  # ids handed out so far are 1 .. _next_graph_id - 1 (see the class docstring)

    def _load(self) -> None:
        """The base session. With ``enable_cuda_graph``, ONNX Runtime refuses a graph any of whose nodes it
        places off the CUDA EP (shape arithmetic on the CPU, say); such a graph then runs uncaptured."""
        try:
            self._session("base")
        except BundleError as refused:
            if not self.cuda_graphs:
                raise
            self._provider_options = {**self._provider_options, "enable_cuda_graph": "0"}
            self._session("base")  # a graph ONNX Runtime cannot load at all fails here, as it would have anyway
            self.cuda_graphs = False
            reason = str(refused).rstrip(".")
            warnings.warn(f"ort-cuda runs without CUDA graphs: with enable_cuda_graph, {reason}.", RuntimeWarning,
                          stacklevel=3)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        m = self.manifest.model
        return KVCache.allocate_for(m.num_layers, m.num_kv_heads, m.head_dim, batch, capacity,
                                    self.pool.allocator())

    def _bind(self, feed: StepInputs, past: list, graph_id: int) -> _Binding:
        from .trt import DeviceArray

        b, t = feed.input_ids.shape
        k = len(feed.logits_index)
        m = self.manifest.model
        binding = self.session.io_binding()
        inputs = {}
        for name in INPUT_NAMES:
            host = getattr(feed, name)
            buf = inputs[name] = DeviceArray(host.shape, self._in_dtype[name], self.stream)
            binding.bind_input(name, "cuda", 0, buf.dtype, list(buf.shape), buf.ptr)
        for past_name, present_name, buf in zip(self._past, self._present, past):
            binding.bind_input(past_name, "cuda", 0, buf.dtype, list(buf.shape), buf.ptr)
            binding.bind_output(present_name, "cuda", 0, buf.dtype, list(buf.shape), buf.ptr)  # in place
        logits = DeviceArray((b, k, m.vocab_size), self._out_dtype[LOGITS], self.stream)
        hidden = DeviceArray((b, t, m.hidden_size), self._out_dtype[HIDDEN_STATES], self.stream)
        binding.bind_output(LOGITS, "cuda", 0, logits.dtype, list(logits.shape), logits.ptr)
        binding.bind_output(HIDDEN_STATES, "cuda", 0, hidden.dtype, list(hidden.shape), hidden.ptr)
        return _Binding(binding, inputs, logits, hidden, graph_id, tuple(p.ptr for p in past))

    def _run(self, bound: _Binding, feed: StepInputs, graph_id: int | None = None) -> None:
        """One run over the binding: uncaptured (-1), or capturing or replaying ``bound.graph_id``."""
        import onnxruntime as ort

        for name, buf in bound.inputs.items():
            buf.upload(getattr(feed, name))
        self._check(self._rt.cudaStreamSynchronize(self.stream))  # ORT runs on its own stream
        ro = ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", str(bound.graph_id if graph_id is None else graph_id))
        self.session.run_with_iobinding(bound.binding, ro)

    def _captured(self, padded, past: list) -> _Binding:
        """The binding of a padded step's key, made (and its graph captured) when new or stale."""
        key = (padded.key.batch, padded.key.capacity, padded.key.t_pad)
        bound = self._bindings.get(key)
        if bound is not None and bound.past_ptrs == tuple(p.ptr for p in past):
            self._run(bound, padded.inputs)  # replay
            return bound
        if bound is not None:  # the cache buffers changed: its graph's baked-in addresses are stale
            bound.free()
        bound = self._bindings[key] = self._bind(padded.inputs, past, graph_id=self._next_graph_id)
        self._next_graph_id += 1
        # ONNX Runtime captures a new id on its first run, and its memory arena must not grow during a
        # capture: one uncaptured run first. Running twice is harmless: the second run writes the same
        # cache rows with the same values (they depend on the inputs and the committed rows only).
        self._run(bound, padded.inputs, graph_id=-1)
        self._run(bound, padded.inputs)  # captures, then ONNX Runtime replays it to produce the outputs
        return bound

    def step(self, inputs: StepInputs, cache: KVCache) -> StepOutputs:
        from ..capture import prepare_captured_step

        padded = prepare_captured_step(inputs, cache, self.t_buckets, self.cap_buckets) if self.cuda_graphs else None
        past = cache.buffers()
        if padded is not None:
            bound = self._captured(padded, past)
            n, k = padded.n_real, padded.k_real
        else:
            bound = self._bind(inputs, past, graph_id=-1)  # -1: run without capturing
            self._run(bound, inputs)
            n, k = inputs.input_ids.shape[1], len(inputs.logits_index)
        logits = bound.logits.download_rows(k)
        hidden = bound.hidden.download_rows(n)
        if padded is None:
            bound.free()
        return StepOutputs(logits=logits.astype(np.float32, copy=False),
                           hidden_states=hidden.astype(np.float32, copy=False))

    def forget_buffers(self) -> None:
        """Free every binding (their graphs' ids are not handed out again)."""
        for bound in self._bindings.values():
            bound.free()
        self._bindings.clear()

    def close(self) -> None:
        self.forget_buffers()
        if getattr(self, "pool", None) is not None:
            self.pool.free()
        super().close()
