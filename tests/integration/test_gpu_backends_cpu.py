"""The GPU backends' control flow on a CPU: OrtCudaBackend and the TensorRT engine build, run over
stand-ins for ONNX Runtime's CUDA session, the CUDA runtime and TensorRT's builder (``gpu_standins.py``)."""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import numpy as np
import onnxruntime
import pytest
from gpu_standins import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    LIMITS,
    PAST,
    PRESENT,
    FakeCuda,
    FakeTrt,
    Reference,
    assert_same,
    decode,
    fake_graph,
    manifest,
)
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors
from specdeploy.runtime.backends.ort import OrtCudaBackend
from specdeploy.runtime.backends.trt import DeviceArray
from specdeploy.runtime.backends.trt_profiles import optimization_profiles
from specdeploy.runtime.contract import (
    HIDDEN_STATES,
    INPUT_NAMES,
    LOGITS,
)
from specdeploy.runtime.errors import BackendUnavailableError, BundleError
from specdeploy.runtime.kvcache import KVCache


# --- ONNX Runtime's CUDA session --------------------------------------------------------------------------
class FakeBinding:
    def __init__(self):
        self.bound: dict[str, tuple] = {}  # name -> (shape, dtype, ptr)

    def bind_input(self, name, device, device_id, dtype, shape, ptr):
        assert device == "cuda"
        self.bound[name] = (tuple(shape), np.dtype(dtype), ptr)

    bind_output = bind_input


class FakeOrt:
    """InferenceSession on the CUDA EP: with ``enable_cuda_graph`` a new gpu_graph_id is captured on its first
    run and replayed after, whatever is bound. Running at shapes the arena has not seen allocates, which a
    capture may not do."""

    def __init__(self, cuda: FakeCuda):
        self.cuda, self.created, self.log = cuda, [], []
        self.refuse_capture = self.broken = False

    def session(self, path, sess_options=None, providers=None):
        options = providers[0][1]
        self.created.append(providers)
        if self.broken:
            raise ort_errors.InvalidGraph("[ONNXRuntimeError] : 10 : INVALID_GRAPH : broken graph")
        if self.refuse_capture and options.get("enable_cuda_graph") == "1":
            raise ort_errors.Fail(
                "This session cannot use the graph capture feature as requested by the user as "
                "all compute graph nodes have not been partitioned to the CUDAExecutionProvider"
            )
        session = SimpleNamespace(
            io_binding=FakeBinding, arena=set(), graphs={}, capture=options.get("enable_cuda_graph") == "1"
        )
        session.run_with_iobinding = functools.partial(self.run, session)
        return session

    def run(self, session, binding: FakeBinding, run_options) -> None:
        capture = session.capture
        graph_id = int(run_options.get_run_config_entry("gpu_graph_id"))
        kind = (
            "run" if not capture or graph_id == -1 else "replay" if graph_id in session.graphs else "capture"
        )
        shapes = frozenset((name, shape) for name, (shape, _, _) in binding.bound.items())
        if kind != "replay" and shapes not in session.arena:
            assert kind != "capture", "the memory arena grew during a CUDA graph capture"
            session.arena.add(shapes)
        if kind == "capture":
            session.graphs[graph_id] = dict(binding.bound)
        self.log.append((graph_id, binding, kind))
        self.compute(session.graphs[graph_id] if kind != "run" else binding.bound)

    def compute(self, bound: dict) -> None:
        def view(name):
            shape, dtype, ptr = bound[name]
            return self.cuda.view(ptr, shape, dtype)

        present = [view(n) for n in PRESENT]
        logits, hidden = fake_graph(*(view(n) for n in INPUT_NAMES), [view(n) for n in PAST], present)
        view(LOGITS)[...] = logits
        view(HIDDEN_STATES)[...] = hidden


@pytest.fixture
def ort(cuda, monkeypatch):
    fake = FakeOrt(cuda)
    monkeypatch.setattr(onnxruntime, "InferenceSession", fake.session)
    monkeypatch.setattr(
        onnxruntime,
        "get_available_providers",
        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    return fake


def test_ort_cuda_captures_each_binding_once_under_a_fresh_id(ort, cuda, tmp_path):
    """One generation replays its keys' graphs. Then two caches take turns on the same keys: every re-bind
    captures a new id after an uncaptured warm-up, no id is reused (also not after forget_buffers), and
    every step matches the uncaptured reference."""
    want = list(decode(Reference()))
    with OrtCudaBackend(tmp_path, manifest()) as backend:
        assert backend.cuda_graphs and backend.name == "ort-cuda-fp32"
        for got, ref in zip(decode(backend), want):
            assert_same(got, ref)
        assert sum(kind == "replay" for _, _, kind in ort.log) > 10
        mine = []  # a cache from outside the backend's pool: its buffers are not the pool's
        other = KVCache.allocate_for(
            LAYERS,
            KV_HEADS,
            HEAD_DIM,
            1,
            256,
            lambda s: mine.append(DeviceArray(s, np.float32, backend.stream).zero()) or mine[-1],
        )
        for i, (a, b, ref) in enumerate(zip(decode(backend), decode(backend, other), want)):
            assert_same(a, ref)
            assert_same(b, ref)
            if i == 12:
                stale = [buf.ptr for bound in backend._bindings.values() for buf in bound.inputs.values()]
                backend.forget_buffers()
                assert all(p in cuda.dead for p in stale)  # freed, not leaked
    assert set(cuda.live) == {b.ptr for b in mine}  # closed: stale bindings were freed at each re-bind
    captures = [(i, gid, binding) for i, (gid, binding, kind) in enumerate(ort.log) if kind == "capture"]
    ids = [gid for _, gid, _ in captures]
    assert len(ids) > 10 and len(set(ids)) == len(ids) and -1 not in ids
    for i, gid, binding in captures:
        assert ort.log[i - 1] == (-1, binding, "run")  # warmed up uncaptured, on the same buffers


def test_ort_cuda_falls_back_to_uncaptured_when_capture_is_refused(ort, tmp_path):
    ort.refuse_capture = True
    with pytest.warns(RuntimeWarning) as caught:
        backend = OrtCudaBackend(tmp_path, manifest())
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert msg.startswith("ort-cuda runs without CUDA graphs") and "graph capture feature" in msg
    assert "\n" not in msg
    assert not backend.cuda_graphs
    assert [p[0][1]["enable_cuda_graph"] for p in ort.created] == ["1", "0"]
    for got, want in zip(decode(backend), decode(Reference())):
        assert_same(got, want)
    assert {(gid, kind) for gid, _, kind in ort.log} == {(-1, "run")}
    backend.close()


def test_ort_cuda_a_graph_that_does_not_load_is_one_error(ort, tmp_path):
    ort.broken = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(BundleError, match="ONNX Runtime cannot load 'base.onnx'.*broken graph"):
            OrtCudaBackend(tmp_path, manifest())


def test_ort_gpu_backends_name_their_precision(ort, tmp_path):
    with pytest.raises(BackendUnavailableError) as err:
        OrtCudaBackend(tmp_path, manifest(), precision="fp16")
    msg = str(err.value)
    assert (
        "fp32 graph only" in msg and "'trt' backend" in msg and "'torch' backend" in msg and "\n" not in msg
    )
    assert not ort.created  # refused before loading anything
    with pytest.raises(BackendUnavailableError, match="not 'int8'"):
        OrtCudaBackend(tmp_path, manifest(), provider="tensorrt", precision="int8")
    with OrtCudaBackend(tmp_path, manifest(), provider="tensorrt", precision="fp16") as backend:
        assert backend.name == "ort-tensorrt-fp16" and not backend.cuda_graphs
        assert ort.created[-1][0][0] == "TensorrtExecutionProvider"
        assert ort.created[-1][0][1]["trt_fp16_enable"] == "1"


# --- the engine build -------------------------------------------------------------------------------------
class Tensor:
    def __init__(self, network, name, dtype):
        self.network, self.name, self._dtype, self.allowed_formats = network, name, dtype, -1

    @property
    def dtype(self):
        return self._dtype

    @dtype.setter
    def dtype(
        self, value
    ):  # TensorRT sets the type of network inputs, and of outputs in a weakly typed network
        net = self.network
        assert self in net.inputs or (self in net.outputs and not net.strongly_typed), self.name
        self._dtype = value


class Layer:
    def __init__(self, kind, inputs, outputs):
        self.kind, self.inputs, self.outputs = kind, list(inputs), outputs
        self.num_inputs = len(inputs)

    def get_input(self, j):
        return self.inputs[j]

    def set_input(self, j, tensor):
        self.inputs[j] = tensor

    def get_output(self, j):
        return self.outputs[j]


class Network:
    """What the parser makes of the base graph: per cache input a scatter giving the present output,
    an attention reading every present tensor, and a head."""

    def __init__(self, strongly_typed: bool):
        self.strongly_typed = strongly_typed
        entry = manifest().graph("base")
        self.inputs = [Tensor(self, s.name, getattr(FakeTrt, s.dtype)) for s in entry.inputs]
        by_name = {t.name: t for t in self.inputs}
        self.layers = [
            Layer("scatter", [by_name[p], by_name["write_indices"]], [Tensor(self, q, FakeTrt.float32)])
            for p, q in zip(PAST, PRESENT)
        ]
        presents = [layer.outputs[0] for layer in self.layers]
        hidden = Tensor(self, HIDDEN_STATES, FakeTrt.float32)
        self.layers.append(Layer("attention", [*presents, by_name["attention_mask"]], [hidden]))
        self.layers.append(Layer("head", [hidden], [Tensor(self, LOGITS, FakeTrt.float32)]))
        self.outputs = [self.layers[-1].outputs[0], hidden, *presents]

    num_inputs = property(lambda self: len(self.inputs))
    num_outputs = property(lambda self: len(self.outputs))
    num_layers = property(lambda self: len(self.layers))

    def get_input(self, i):
        return self.inputs[i]

    def get_output(self, i):
        return self.outputs[i]

    def get_layer(self, i):
        return self.layers[i]

    def add_cast(self, tensor, to):
        self.layers.append(Layer("cast", [tensor], [Tensor(self, f"cast_{len(self.layers)}", to)]))
        return self.layers[-1]

    def mark_output(self, tensor):
        self.outputs.append(tensor)

    def unmark_output(self, tensor):
        self.outputs.remove(tensor)


def test_build_gives_reduced_precision_engines_reduced_precision_kv_io(monkeypatch, tmp_path):
    from specdeploy.exporter.build import trt as trt_build

    built = []

    class Config:
        def __init__(self):
            self.flags = []

        def __getattr__(self, name):  # memory pool, profiles, timing cache: accepted
            return lambda *a, **k: SimpleNamespace(serialize=lambda: b"T", set_shape=lambda *a: None)

        def set_flag(self, flag):
            self.flags.append(flag)

    class Builder:
        def __init__(self, logger):
            pass

        def create_builder_config(self):
            return Config()

        def create_network(self, flags):
            return Network(strongly_typed=False)

        def create_optimization_profile(self):
            return SimpleNamespace(set_shape=lambda *a: None)

        def build_serialized_network(self, network, config):
            built.append((network, list(config.flags)))
            return b"PLAN"

    trt = type(
        "Trt",
        (FakeTrt,),
        {
            "Builder": Builder,
            "MemoryPoolType": SimpleNamespace(WORKSPACE=0),
            "BuilderFlag": SimpleNamespace(FP16="FP16", BF16="BF16"),
            "TensorFormat": SimpleNamespace(LINEAR=0),
            "NetworkDefinitionCreationFlag": SimpleNamespace(),
            "OnnxParser": lambda network, logger: SimpleNamespace(parse_from_file=lambda path: True),
        },
    )
    entry = manifest().graph("base")
    profiles = optimization_profiles(LIMITS)
    for precision in ("fp16", "fp32"):
        plan, _ = trt_build._build_one(
            trt,
            tmp_path / "base.onnx",
            entry,
            profiles,
            trt_build.BuildConfig(precision),
            b"",
            lambda msg: None,
        )
        assert plan == b"PLAN"
    (fp16, flags16), (fp32, flags32) = built
    assert flags16 == ["FP16"] and flags32 == []
    io16 = {t.name: t for t in (*fp16.inputs, *fp16.outputs)}
    assert {n for n, t in io16.items() if t.dtype is FakeTrt.float16} == {*PAST, *PRESENT}
    assert all(io16[n].allowed_formats == 1 for n in (*PAST, *PRESENT))  # linear only
    assert io16["input_ids"].dtype is FakeTrt.int64 and io16[LOGITS].dtype is FakeTrt.float32
    assert all(t.dtype is not FakeTrt.float16 for t in (*fp32.inputs, *fp32.outputs))


def test_strongly_typed_kv_io_is_cast_at_the_edges():
    """A strongly typed network infers its types: the bf16 cache inputs are cast back for the layers that
    read them, and the bf16 cache outputs are casts of the graph's own."""
    from specdeploy.exporter.build import trt as trt_build

    trt = type("Trt", (FakeTrt,), {"TensorFormat": SimpleNamespace(LINEAR=0)})
    net = Network(strongly_typed=True)
    scatters = {layer.outputs[0].name: layer for layer in net.layers if layer.kind == "scatter"}
    graph_present = [layer.outputs[0] for layer in scatters.values()]
    names = trt_build.kv_io_names(manifest().graph("base"))
    assert names == {*PAST, *PRESENT}
    assert trt_build._reduce_kv_io(trt, net, names, "bf16", strongly_typed=True) == len(names)
    inputs = {t.name: t for t in net.inputs}
    for past, present in zip(PAST, PRESENT):
        assert inputs[past].dtype is FakeTrt.bfloat16
        read = scatters[present].get_input(0)  # the scatter now reads a cast of the bf16 input to fp32
        cast = next(layer for layer in net.layers if layer.outputs[0] is read)
        assert cast.kind == "cast" and cast.inputs == [inputs[past]] and read.dtype is FakeTrt.float32
    outputs = {t.name: t for t in net.outputs}
    assert list(outputs)[:2] == [LOGITS, HIDDEN_STATES] and outputs[LOGITS].dtype is FakeTrt.float32
    for present, source in zip(PRESENT, graph_present):
        out = outputs[present]
        cast = next(layer for layer in net.layers if layer.outputs[0] is out)
        assert out.dtype is FakeTrt.bfloat16 and out.allowed_formats == 1
        assert cast.kind == "cast" and cast.inputs == [source] and source.name != present
    attention = next(layer for layer in net.layers if layer.kind == "attention")
    assert attention.inputs[: len(PRESENT)] == graph_present  # the graph itself still reads its own tensors
    assert trt_build._reduce_kv_io(trt, Network(True), names, "fp32", strongly_typed=True) == 0
