"""Stand-ins for the GPU backends' tests on a CPU: a CUDA runtime over host memory and a step graph.

The stand-in "device" memory is host memory handed out by a fake ``cudaMalloc``; every copy checks that it
stays inside a live allocation. The stand-in graph (:func:`fake_graph`) writes the step's K/V rows at
``write_indices`` and derives hidden states and logits from the cache slots each row sees, so a wrong
binding, a stale address or a wrongly replayed graph shows as wrong numbers. A captured graph replays with
the addresses it was captured with, whatever is bound now, as on a GPU.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
from specdeploy.runtime.backends.base import Backend, StepInputs, StepOutputs
from specdeploy.runtime.bundle import (
    BundleManifest,
    EngineEntry,
    GraphEntry,
    Limits,
    ModelConfig,
    SourceInfo,
    TensorSpec,
    TokenizerInfo,
)
from specdeploy.runtime.contract import (
    INPUT_NAMES,
    STEP_INPUTS,
    kv_dims,
    past_names,
    present_names,
    step_outputs,
)
from specdeploy.runtime.kvcache import KVCache, capacity_buckets
from specdeploy.runtime.tree import build_buffers

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 2, 2, 2, 3, 5
LIMITS = Limits(max_batch=1, max_tree=4, max_context=300)
BUCKETS = capacity_buckets(300, 4)  # (256, 304)
GPU = SimpleNamespace(name=b"NVIDIA H200", major=9, minor=0)
TRT_VERSION = "10.15.1.29"
PAST, PRESENT = past_names(LAYERS), present_names(LAYERS)
# (parents, accepted nodes) of the decode steps: T = 1, 2, 3, 4 (padded to 1, 2, 4, 4), commits that move rows.
STEPS = [([-1], [0]), ([-1, 0], [0, 1]), ([-1, 0, 0], [0, 2]), ([-1, 0, 1, 1], [0, 1, 3])] * 5


def fake_graph(ids, pos, mask, widx, lidx, past, present):
    """The stand-in step graph. Values stay small multiples of 1/4, so fp16 caches and float32 sums are exact."""
    for i, (src, dst) in enumerate(zip(past, present)):
        if dst is not src:
            dst[...] = src
        layer, kind = divmod(i, 2)
        rows = ids + pos % 64 + 0.5 * layer + 0.25 * kind  # [B, T]
        dst[:, :, widx, :] = rows[:, None, :, None]
    k0 = present[0][:, 0, :, 0].astype(np.float32)  # [B, C]
    seen = np.where(mask[:, 0] == 0, k0[:, None, :], 0).sum(-1)  # [B, T]
    hidden = (seen[..., None] + np.arange(HIDDEN)).astype(np.float32)  # [B, T, H]
    logits = (hidden[:, lidx, :1] * (np.arange(VOCAB) + 1)).astype(np.float32)  # [B, K, V]
    return logits, hidden


def manifest(kv: str = "float32", engine_precision: str = "fp16") -> BundleManifest:
    kv_spec = kv_dims(KV_HEADS, HEAD_DIM)
    inputs = [TensorSpec(n, d, s) for n, d, s in STEP_INPUTS] + [TensorSpec(n, kv, kv_spec) for n in PAST]
    outputs = [TensorSpec(n, d, s) for n, d, s in step_outputs(VOCAB, HIDDEN)] + [
        TensorSpec(n, kv, kv_spec) for n in PRESENT
    ]
    graph = GraphEntry("base", "base.onnx", "sha", (), tuple(inputs), tuple(outputs), 17)
    engine = EngineEntry(
        "base", f"engines/base-{engine_precision}.plan", "NVIDIA H200", "9.0", TRT_VERSION, engine_precision
    )
    model = ModelConfig("LlamaForCausalLM", "llama", VOCAB, HIDDEN, LAYERS, 4, KV_HEADS, HEAD_DIM, 2048, (2,))
    return BundleManifest(
        model,
        (graph,),
        LIMITS,
        TokenizerInfo("tokenizer.json", None, None, None),
        SourceInfo("m", "hf", "sha"),
        (),
        engines=(engine,),
    )


class Reference(Backend):
    """The stand-in graph on numpy caches, unpadded and uncaptured: what every backend must return."""

    def __init__(self, kv_dtype=np.float32):
        self.kv_dtype = kv_dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache.allocate_for(
            LAYERS, KV_HEADS, HEAD_DIM, batch, capacity, lambda s: np.zeros(s, self.kv_dtype)
        )

    def step(self, inputs: StepInputs, cache: KVCache) -> StepOutputs:
        past = cache.buffers()
        return StepOutputs(*fake_graph(*(getattr(inputs, n) for n in INPUT_NAMES), past, past))


def tree_inputs(cache: KVCache, parents: list[int], tokens) -> StepInputs:
    length, n = cache.length, len(parents)
    buf = build_buffers(parents)
    neg = np.finfo(np.float32).min
    mask = np.full((1, 1, n, cache.capacity), neg, np.float32)
    mask[..., :length] = 0.0
    mask[0, 0, :, length : length + n] = np.where(buf.mask, 0.0, neg)
    k = np.arange(n) if length else np.array([n - 1])
    return StepInputs(
        np.asarray(tokens, np.int64)[None],
        (length + buf.depth)[None].astype(np.int64),
        mask,
        np.arange(length, length + n, dtype=np.int64),
        k.astype(np.int64),
    )


def decode(backend, cache: KVCache | None = None):
    """Prefill 250 tokens, then the STEPS, committing as a decoder does; yields each step's outputs."""
    cache = cache or backend.new_cache(1, 256)
    yield backend.step(tree_inputs(cache, list(range(-1, 249)), np.arange(250) % 50 + 1), cache)
    cache.length = 250
    for i, (parents, accepted) in enumerate(STEPS):
        cache.ensure_capacity(cache.length + len(parents), BUCKETS)
        yield backend.step(tree_inputs(cache, parents, (np.arange(len(parents)) * 7 + i) % 50 + 1), cache)
        cache.commit(cache.length + np.asarray(accepted))


def assert_same(got: StepOutputs, want: StepOutputs) -> None:
    np.testing.assert_array_equal(got.logits, want.logits)
    np.testing.assert_array_equal(got.hidden_states, want.hidden_states)


# --- the CUDA runtime -------------------------------------------------------------------------------------
class FakeCuda:
    """cuda-python's runtime over host memory; graphs record the launches made while capturing."""

    class cudaError_t:
        cudaSuccess = 0

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice = 1, 2, 3

    class cudaStreamCaptureMode:
        cudaStreamCaptureModeThreadLocal = 0

    def __init__(self):
        self.live: dict[int, np.ndarray] = {}
        self.dead: dict[int, np.ndarray] = {}  # kept, so a stray copy fails an assert instead of the process
        self.capturing: list | None = None
        self.graphs: dict[int, list] = {}
        self.launches = 0

    def span(self, ptr: int, nbytes: int) -> None:
        for base, mem in self.live.items():
            if base <= ptr and ptr + nbytes <= base + mem.nbytes:
                return
        raise AssertionError(f"{nbytes} bytes at {ptr:#x} are not inside a live device allocation")

    def view(self, ptr: int, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        assert ptr in self.live, f"{ptr:#x} is not a live allocation"
        assert n <= self.live[ptr].nbytes, (shape, dtype)
        return self.live[ptr][:n].view(dtype).reshape(shape)

    def cudaMalloc(self, n):
        mem = np.full(n, 0xFF, np.uint8)  # garbage: NaN as floats
        self.live[mem.ctypes.data] = mem
        return 0, mem.ctypes.data

    def cudaFree(self, ptr):
        self.dead[ptr] = self.live.pop(ptr)
        return (0,)

    def cudaMemsetAsync(self, ptr, value, n, stream):
        self.span(ptr, n)
        ctypes.memset(ptr, value, n)
        return (0,)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        return self.cudaMemcpy2DAsync(dst, n, src, n, n, 1, kind, stream)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        if kind != self.cudaMemcpyKind.cudaMemcpyDeviceToHost:
            self.span(dst, dpitch * (height - 1) + width)
        if kind != self.cudaMemcpyKind.cudaMemcpyHostToDevice:
            self.span(src, spitch * (height - 1) + width)
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return (0,)

    def cudaStreamBeginCapture(self, stream, mode):
        self.capturing = []
        return (0,)

    def cudaStreamEndCapture(self, stream):
        graph, self.capturing = self.capturing, None
        return 0, graph

    def cudaGraphInstantiate(self, graph, flags):
        self.graphs[len(self.graphs) + 1] = graph
        return 0, len(self.graphs)

    def cudaGraphLaunch(self, graph_exec, stream):
        self.launches += 1
        for launch in self.graphs[graph_exec]:
            launch()
        return (0,)

    cudaStreamSynchronize = cudaGraphDestroy = cudaGraphExecDestroy = staticmethod(lambda *args: (0,))
    cudaStreamCreate = staticmethod(lambda: (0, 7))
    cudaGetDeviceCount = staticmethod(lambda: (0, 1))
    cudaGetDeviceProperties = staticmethod(lambda device: (0, GPU))
    cudaGetErrorString = staticmethod(lambda err: (0, b"fake CUDA error"))


def host(cuda: FakeCuda, buf) -> np.ndarray:
    return cuda.view(buf.ptr, buf.shape, buf.dtype).copy()


# --- TensorRT's module ---------------------------------------------------------------------------------
class DT:
    def __init__(self, name: str):
        self.name = name


class FakeTrt:
    __version__ = TRT_VERSION
    float32, float16, bfloat16, int64 = DT("float32"), DT("float16"), DT("bfloat16"), DT("int64")

    class Logger:
        ERROR, WARNING = 1, 2

        def __init__(self, level):
            pass

    @staticmethod
    def nptype(dt: DT):
        if dt.name == "bfloat16":
            raise TypeError("Could not resolve TensorRT datatype to an equivalent numpy datatype.")
        return np.dtype(dt.name)
