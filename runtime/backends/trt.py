"""Native TensorRT backend, plus the TensorRT bookkeeping shared with the builder and the ORT TRT-EP.

Pure parts (tested on CPU): optimization profiles (:func:`optimization_profiles`), which profile a
shape runs under (:func:`pick_profile`), where engines live (:func:`engine_dir_name`) and which engine
a machine may load (:func:`select_engine`).

Device parts (on the CPU machines this project develops on, only their control flow is tested, over
stand-ins for TensorRT and the CUDA runtime; ``scripts/gpu_check.sh`` runs them where TensorRT is
installed): ``tensorrt`` and ``cuda-python`` are imported lazily. Every buffer is preallocated device
memory bound with ``set_tensor_address``; steps run with ``execute_async_v3`` on one stream. Decode steps are captured as CUDA graphs keyed by (capacity bucket,
padded T, ping-pong parity), following :mod:`specdeploy.runtime.capture`: warm up once, capture, then
replay with the inputs copied into the fixed buffers. Only the real rows of logits and hidden states
are copied back to the host.

KV write. The graph writes the cache with a scatter (ScatterElements/ScatterND), whose output is a full
copy of ``past`` with the new rows scattered in. TensorRT does not promise that an output may alias an input, so the backend
keeps two buffer sets per capacity bucket and alternates them (``present`` of one step is ``past`` of
the next). See ``exporter/build/trt.py`` for why the KVCacheUpdate layer is not used. The cache is
allocated in the engine's KV dtype: an fp16 (bf16) engine is built with fp16 (bf16) ``past_*`` and
``present_*`` tensors, which halves that copy's traffic against fp32 KV I/O.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..bundle import BundleManifest
from ..capture import prepare_captured_step, tree_buckets
from ..contract import (
    ATTENTION_MASK,
    HIDDEN_STATES,
    INPUT_IDS,
    INPUT_NAMES,
    LAYER_STATES,
    LOGITS,
    LOGITS_INDEX,
    past_names,
    present_names,
)
from ..errors import BackendUnavailableError, BundleError
from ..kvcache import KVCache
from .base import Backend, StepInputs, StepOutputs
from .trt_profiles import DeviceInfo, DimRange, Profile, pick_profile, select_engine

# --- optimization profiles (pure) --------------------------------------------------------------


# --- engines on disk (pure) -----------------------------------------------------------------------


# --- CUDA runtime through cuda-python (lazy) -----------------------------------------------------
def require_tensorrt() -> Any:
    try:
        import tensorrt as trt
    except ImportError:
        raise BackendUnavailableError(
            "TensorRT is not installed: the 'trt' backend and 'specdeploy build' need an NVIDIA GPU with the "
            "tensorrt and cuda-python packages (pip install 'specdeploy[trt]' cuda-python)."
        ) from None
    return trt


def cudart() -> Any:
    try:
        from cuda.bindings import runtime as rt  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart as rt  # older cuda-python
        except ImportError:
            raise BackendUnavailableError(
                "The GPU backends need the cuda-python package for device memory (pip install cuda-python)."
            ) from None
    return rt


def check(result: Any) -> Any:
    """Unwrap a cuda-python ``(err, *values)`` tuple, raising on error."""
    rt = cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        msg = rt.cudaGetErrorString(err)[1]
        raise RuntimeError(f"CUDA error: {msg.decode() if isinstance(msg, bytes) else msg}")
    return values[0] if len(values) == 1 else (values or None)


def kv_host_dtype(trt: Any, engine: Any, name: str) -> np.dtype:
    """The numpy dtype of an engine's cache tensor. NumPy has no bfloat16: a bf16 engine's cache, which
    the host never reads, is held as its 16-bit patterns."""
    dt = engine.get_tensor_dtype(name)
    if dt == getattr(trt, "bfloat16", None):
        return np.dtype(np.uint16)
    return np.dtype(trt.nptype(dt))


def current_device(trt_version: str) -> DeviceInfo:
    rt = cudart()
    err, count = rt.cudaGetDeviceCount()
    if err != rt.cudaError_t.cudaSuccess or count == 0:
        raise BackendUnavailableError("No CUDA GPU is visible on this machine; TensorRT needs one.")
    props = check(rt.cudaGetDeviceProperties(0))
    name = props.name.decode().rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    return DeviceInfo(name, f"{props.major}.{props.minor}", trt_version)


class DeviceArray:
    """A C-contiguous device buffer. Supports exactly the indexing :class:`KVCache` uses on axis 2:

    ``new[:, :, :n] = old[:, :, :n]`` (grow) and ``buf[:, :, dst] = buf[:, :, src]`` (commit).
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any, stream: Any):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.stream = stream
        self.ptr = int(check(cudart().cudaMalloc(max(self.nbytes, 1))))

    def zero(self) -> DeviceArray:
        check(cudart().cudaMemsetAsync(self.ptr, 0, self.nbytes, self.stream))
        return self

    def upload(self, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host, dtype=self.dtype)
        assert host.nbytes == self.nbytes, (host.shape, self.shape)
        rt = cudart()
        check(rt.cudaMemcpyAsync(self.ptr, host.ctypes.data, self.nbytes,
                                 rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def download_rows(self, rows: int) -> np.ndarray:
        """The first ``rows`` entries of axis 1 of a [B, R, X] buffer, as a host array [B, rows, X]."""
        b, r, x = self.shape
        out = np.empty((b, rows, x), dtype=self.dtype)
        es = self.dtype.itemsize
        rt = cudart()
        check(rt.cudaMemcpy2DAsync(out.ctypes.data, rows * x * es, self.ptr, r * x * es, rows * x * es, b,
                                   rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
        check(rt.cudaStreamSynchronize(self.stream))
        return out

    def __getitem__(self, key: tuple) -> tuple[DeviceArray, Any]:
        return (self, key[2])

    def __setitem__(self, key: tuple, value: tuple[DeviceArray, Any]) -> None:
        src, src_idx = value
        dst_idx = key[2]
        b, h, c, d = self.shape
        es = self.dtype.itemsize
        row = d * es
        rt = cudart()
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice

        def copy(dst_slot: int, src_slot: int, n: int) -> None:  # n slots for each of the B*H rows
            check(rt.cudaMemcpy2DAsync(self.ptr + dst_slot * row, c * row, src.ptr + src_slot * row,
                                       src.shape[2] * row, n * row, b * h, kind, self.stream))

        if isinstance(dst_idx, slice):
            n = len(range(*dst_idx.indices(c)))
            if n:
                copy(dst_idx.start or 0, src_idx.start or 0, n)
            return
        dst, srcs = np.asarray(dst_idx), np.asarray(src_idx)
        if np.any(dst > srcs) or np.any(np.diff(dst) <= 0):
            raise ValueError("commit moves rows towards the front only, in increasing order")
        for t, s in zip(dst.tolist(), srcs.tolist()):  # increasing order never overwrites a later source
            if t != s:
                copy(t, s, 1)

    def free(self) -> None:
        if self.ptr:
            cudart().cudaFree(self.ptr)
            self.ptr = 0


class CachePool:
    """Persistent device cache buffers per bucket, so the addresses baked into captured graphs stay valid.

    ``allocator()`` hands a KVCache the pool's buffers in allocation order (KVCache allocates keys then
    values, in the same order every time). With ``ping_pong`` every buffer has a partner that the step
    writes ``present`` into (TensorRT); without it ``present`` aliases ``past`` (ONNX Runtime allows that).
    A backend serves one cache at a time: a second live cache would share these buffers.
    """

    def __init__(self, dtype: Any, stream: Any, ping_pong: bool):
        self.dtype, self.stream, self.ping_pong = dtype, stream, ping_pong
        self._bufs: dict[tuple[int, ...], list[DeviceArray]] = {}
        self._partner: dict[int, DeviceArray] = {}
        self._first: set[int] = set()

    def allocator(self):
        counts: dict[tuple[int, ...], int] = {}

        def allocate(shape: tuple[int, ...]) -> DeviceArray:
            shape = tuple(int(s) for s in shape)
            k = counts.get(shape, 0)
            counts[shape] = k + 1
            bufs = self._bufs.setdefault(shape, [])
            if k == len(bufs):
                a = DeviceArray(shape, self.dtype, self.stream)
                b = DeviceArray(shape, self.dtype, self.stream) if self.ping_pong else a
                bufs.append(a)
                self._partner[a.ptr], self._partner[b.ptr] = b, a
                self._first.add(a.ptr)
            return bufs[k].zero()

        return allocate

    def partner(self, buf: DeviceArray) -> DeviceArray:
        return self._partner[buf.ptr]

    def parity(self, buf: DeviceArray) -> int:
        return 0 if buf.ptr in self._first else 1

    def free(self) -> None:
        for bufs in self._bufs.values():
            for a in bufs:
                b = self._partner.get(a.ptr)
                a.free()
                if b is not None and b is not a:
                    b.free()
        self._bufs.clear()
        self._partner.clear()
        self._first.clear()


# --- the backend (UNTESTED here: needs a GPU with TensorRT) ---------------------------------------
def engine_profiles(engine: Any) -> list[Profile]:
    """Read the profiles back from a deserialized engine (it may have been built with smaller limits)."""
    n = engine.num_optimization_profiles
    names = ["prefill", "tree"] + [f"p{i}" for i in range(2, n)] if n >= 2 else ["tree"]
    out = []
    for p in range(n):
        ids = engine.get_tensor_profile_shape(INPUT_IDS, p)  # [min, opt, max] of [B, T]
        mask = engine.get_tensor_profile_shape(ATTENTION_MASK, p)  # [B, 1, T, C]
        lidx = engine.get_tensor_profile_shape(LOGITS_INDEX, p)  # [K]
        out.append(Profile(
            names[p],
            DimRange(ids[0][0], ids[1][0], ids[2][0]),
            DimRange(ids[0][1], ids[1][1], ids[2][1]),
            DimRange(mask[0][3], mask[1][3], mask[2][3]),
            DimRange(lidx[0][0], lidx[1][0], lidx[2][0]),
        ))
    return out


class _Slot:
    """Fixed I/O buffers for one set of shapes, and optionally the CUDA graph captured over them.

    TensorRT lets only one execution context use an optimization profile, so the backend keeps one
    context per profile, shared by that profile's slots. A captured graph has the shapes and addresses
    baked in, so a replay needs nothing from the context. An uncaptured execution reads them from the
    context, so the slot puts its own there first, unless the context was last bound for this very slot
    (``TrtBackend.bound_slot``): re-binding the ~65 shapes and ~127 addresses of a real model every step
    costs host time for nothing.
    """

    def __init__(self, backend: TrtBackend, profile: int, feed: StepInputs, past: list[DeviceArray],
                 present: list[DeviceArray]):
        self.backend, self.profile = backend, profile
        trt, engine, stream = backend.trt, backend.engine, backend.stream
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.inputs: dict[str, DeviceArray] = {}
        for name in INPUT_NAMES:
            host = getattr(feed, name)
            self.inputs[name] = DeviceArray(host.shape, trt.nptype(engine.get_tensor_dtype(name)), stream)
            self.shapes[name], self.addresses[name] = tuple(host.shape), self.inputs[name].ptr
        for name, buf in zip(backend.past_names, past):
            self.shapes[name], self.addresses[name] = buf.shape, buf.ptr
        for name, buf in zip(backend.present_names, present):
            self.addresses[name] = buf.ptr
        self.graph_exec = None
        context = self.bind()  # the output shapes follow from the input shapes on the context
        self.outputs: dict[str, DeviceArray] = {}
        # A graph exported with feature_layers has one more output: bound (TensorRT needs every output's
        # address) but not read back, since this backend does not return layer states.
        io = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        for name in (LOGITS, HIDDEN_STATES, *([LAYER_STATES] if LAYER_STATES in io else [])):
            shape = tuple(context.get_tensor_shape(name))
            self.outputs[name] = DeviceArray(shape, trt.nptype(engine.get_tensor_dtype(name)), stream)
            self.addresses[name] = self.outputs[name].ptr
            context.set_tensor_address(name, self.outputs[name].ptr)

    def bind(self) -> Any:
        """Put this slot's shapes and addresses on its profile's context (skipped when they are there)."""
        context = self.backend.contexts[self.profile]
        if self.backend.bound_slot[self.profile] is self:
            return context
        for name, shape in self.shapes.items():
            if not context.set_input_shape(name, shape):
                raise RuntimeError(f"TensorRT rejects shape {shape} for '{name}' in profile {self.profile}")
        for name, ptr in self.addresses.items():
            context.set_tensor_address(name, ptr)
        self.backend.bound_slot[self.profile] = self
        return context

    def load(self, feed: StepInputs) -> None:
        for name, buf in self.inputs.items():
            buf.upload(getattr(feed, name))

    def execute(self) -> None:
        """One uncaptured execution (or the one being captured), from the context's shapes and addresses."""
        if not self.bind().execute_async_v3(self.backend.stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")

    def capture(self) -> None:
        """Warm up (TensorRT allocates lazily on the first run at new shapes), then capture one execution."""
        rt, stream = cudart(), self.backend.stream
        self.execute()
        check(rt.cudaStreamSynchronize(stream))
        check(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        self.execute()
        graph = check(rt.cudaStreamEndCapture(stream))
        self.graph_exec = check(rt.cudaGraphInstantiate(graph, 0))
        check(rt.cudaGraphDestroy(graph))

    def launch(self) -> None:
        if self.graph_exec is None:
            self.execute()
        else:  # its shapes and addresses are in the graph: the context's may be another slot's
            check(cudart().cudaGraphLaunch(self.graph_exec, self.backend.stream))

    def free(self) -> None:
        if self.backend.bound_slot[self.profile] is self:  # its addresses die with it
            self.backend.bound_slot[self.profile] = None
        if self.graph_exec is not None:
            cudart().cudaGraphExecDestroy(self.graph_exec)
            self.graph_exec = None
        for buf in (*self.inputs.values(), *self.outputs.values()):
            buf.free()


class TrtBackend(Backend):
    """Runs the bundle's base TensorRT engine built for this GPU (see ``specdeploy build``)."""

    def __init__(self, bundle_dir: str | Path, manifest: BundleManifest, precision: str | None = None,
                 cuda_graphs: bool = True):
        trt = require_tensorrt()
        rt = cudart()
        self.trt, self.bundle_dir, self.manifest = trt, Path(bundle_dir), manifest
        device = current_device(trt.__version__)
        entry = select_engine(manifest.engines, "base", device, precision)
        path = self.bundle_dir / entry.file
        if not path.is_file():
            raise BundleError(f"The bundle is incomplete: TensorRT engine '{entry.file}' is listed but missing.")
        self.logger = trt.Logger(trt.Logger.ERROR)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise BundleError(
                f"TensorRT {trt.__version__} cannot load engine '{entry.file}' (built for {entry.gpu} with "
                f"TensorRT {entry.trt_version}); rebuild it with 'specdeploy build BUNDLE'."
            )
        self.name = f"trt-{entry.precision}"
        self.cuda_graphs = cuda_graphs
        self.stream = check(rt.cudaStreamCreate())
        m = manifest.model
        self.past_names, self.present_names = past_names(m.num_layers), present_names(m.num_layers)
        self._mask_dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(ATTENTION_MASK)))
        self.profiles = engine_profiles(self.engine)
        self.t_buckets = tree_buckets(min(manifest.limits.max_tree, max(p.tree.max for p in self.profiles
                                                                         if p.name == "tree")))
        self.cap_buckets = manifest.capacity_buckets
        # The cache lives in the engine's KV dtype (fp16 for an fp16 engine, see exporter/build/trt.py).
        # present becomes the next step's past, so both must have it.
        kv = {n: kv_host_dtype(trt, self.engine, n) for n in (*self.past_names, *self.present_names)}
        self.kv_dtype = kv[self.past_names[0]]
        mixed = sorted({str(d) for d in kv.values()})
        if len(mixed) > 1:
            raise BundleError(f"TensorRT engine '{entry.file}' mixes KV dtypes ({', '.join(mixed)}); rebuild it "
                              "with 'specdeploy build BUNDLE'.")
        self.pool = CachePool(self.kv_dtype, self.stream, ping_pong=True)
        self.contexts = []
        for p in range(self.engine.num_optimization_profiles):
            context = self.engine.create_execution_context()
            if not context.set_optimization_profile_async(p, self.stream):
                raise RuntimeError(f"TensorRT refused optimization profile {p}")
            self.contexts.append(context)
        self.bound_slot: list[_Slot | None] = [None] * len(self.contexts)  # whose shapes each context holds
        self._slots: dict[tuple, _Slot] = {}

    @property
    def mask_dtype(self) -> np.dtype:
        return self._mask_dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        m = self.manifest.model
        return KVCache.allocate_for(m.num_layers, m.num_kv_heads, m.head_dim, batch, capacity,
                                    self.pool.allocator())

    def step(self, inputs: StepInputs, cache: KVCache) -> StepOutputs:
        padded = prepare_captured_step(inputs, cache, self.t_buckets, self.cap_buckets) if self.cuda_graphs else None
        feed = padded.inputs if padded is not None else inputs
        n = padded.n_real if padded is not None else inputs.input_ids.shape[1]
        k = padded.k_real if padded is not None else len(inputs.logits_index)
        past = cache.buffers()
        present = [self.pool.partner(b) for b in past]
        b, t = feed.input_ids.shape
        c, kk = feed.attention_mask.shape[3], len(feed.logits_index)
        profile = pick_profile(self.profiles, b, t, c, kk)
        if padded is not None:
            key = (b, c, t, self.pool.parity(past[0]))
            slot = self._slots.get(key)
            fresh = slot is None
            if fresh:
                slot = self._slots[key] = _Slot(self, profile, feed, past, present)
            slot.load(feed)
            if fresh:
                slot.capture()  # its warm-up run computes the step; the launch below repeats it
            slot.launch()
        else:  # prefill and oversized steps: throwaway buffers at these exact shapes
            slot = _Slot(self, profile, feed, past, present)
            slot.load(feed)
            slot.launch()
        logits = slot.outputs[LOGITS].download_rows(k)  # [B, K, V]; syncs the stream
        hidden = slot.outputs[HIDDEN_STATES].download_rows(n)  # [B, N, H]
        if padded is None:
            slot.free()
        # present (the partner set) now holds the cache: swap it in.
        L = self.manifest.model.num_layers
        cache.keys[:] = [present[2 * i] for i in range(L)]
        cache.values[:] = [present[2 * i + 1] for i in range(L)]
        cache.epoch += 1
        return StepOutputs(logits=logits.astype(np.float32, copy=False),
                           hidden_states=hidden.astype(np.float32, copy=False))

    def close(self) -> None:
        for slot in self._slots.values():
            slot.free()
        self._slots.clear()
        self.contexts, self.bound_slot = [], []
        if getattr(self, "pool", None) is not None:
            self.pool.free()
