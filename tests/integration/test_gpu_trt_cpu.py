"""TrtBackend and its _Slot on a CPU, over stand-ins for the CUDA runtime and a TensorRT engine
(``gpu_standins.py``): outputs, committed cache rows, and which calls each step makes."""

from __future__ import annotations

import functools
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from gpu_standins import (
    DT,
    HEAD_DIM,
    HIDDEN,
    KV_HEADS,
    LIMITS,
    PAST,
    PRESENT,
    STEPS,
    VOCAB,
    FakeCuda,
    FakeTrt,
    Reference,
    assert_same,
    decode,
    fake_graph,
    host,
    manifest,
    tree_inputs,
)
from specdeploy.runtime.backends import trt as trt_mod
from specdeploy.runtime.backends.trt import TrtBackend, _Slot
from specdeploy.runtime.backends.trt_profiles import optimization_profiles
from specdeploy.runtime.contract import (
    HIDDEN_STATES,
    INPUT_NAMES,
    LOGITS,
)
from specdeploy.runtime.errors import BundleError
from specdeploy.runtime.kvcache import KVCache


# --- TensorRT ---------------------------------------------------------------------------------------------
class FakeContext:
    """An execution context: shapes and addresses set on it, read by the launches made from it."""

    def __init__(self, engine):
        self.engine, self.shapes, self.addresses, self.calls = engine, {}, {}, Counter()

    def set_optimization_profile_async(self, profile, stream):
        return True

    def set_input_shape(self, name, shape):
        self.calls["set_input_shape"] += 1
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.calls["set_tensor_address"] += 1
        self.addresses[name] = ptr

    def get_tensor_shape(self, name, shapes=None):
        (b, t), (k,) = (shapes or self.shapes)["input_ids"], (shapes or self.shapes)["logits_index"]
        return {LOGITS: (b, k, VOCAB), HIDDEN_STATES: (b, t, HIDDEN)}[name]

    def execute_async_v3(self, stream):
        run = functools.partial(
            self.run, dict(self.shapes), dict(self.addresses)
        )  # what a kernel launch holds
        if self.engine.cuda.capturing is None:
            run()
        else:
            self.engine.cuda.capturing.append(run)
        return True

    def run(self, shapes, addresses):
        def view(name, shape):
            return self.engine.cuda.view(addresses[name], shape, self.engine.host_dtype(name))

        present = [view(n, shapes[p]) for n, p in zip(PRESENT, PAST)]
        logits, hidden = fake_graph(
            *(view(n, shapes[n]) for n in INPUT_NAMES), [view(n, shapes[n]) for n in PAST], present
        )
        view(LOGITS, self.get_tensor_shape(LOGITS, shapes))[...] = logits
        view(HIDDEN_STATES, self.get_tensor_shape(HIDDEN_STATES, shapes))[...] = hidden


class FakeEngine:
    def __init__(self, cuda: FakeCuda, kv: DT, present_kv: DT | None = None):
        self.cuda, self.contexts = cuda, []
        spec = manifest().graph("base")
        self.names = [s.name for s in (*spec.inputs, *spec.outputs)]
        self.dtypes = {s.name: getattr(FakeTrt, s.dtype) for s in (*spec.inputs, *spec.outputs)}
        self.dtypes.update({n: kv for n in PAST} | {n: present_kv or kv for n in PRESENT})
        self.profiles = optimization_profiles(LIMITS)
        self.num_optimization_profiles, self.num_io_tensors = len(self.profiles), len(self.names)

    def host_dtype(self, name):
        dt = self.dtypes[name]
        return np.uint16 if dt is FakeTrt.bfloat16 else FakeTrt.nptype(dt)

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_dtype(self, name):
        return self.dtypes[name]

    def get_tensor_profile_shape(self, name, p):
        pr = self.profiles[p]
        b, t, c, k = ((r.min, r.opt, r.max) for r in (pr.batch, pr.tree, pr.capacity, pr.kept))
        per = {
            "input_ids": lambda i: (b[i], t[i]),
            "attention_mask": lambda i: (b[i], 1, t[i], c[i]),
            "logits_index": lambda i: (k[i],),
        }[name]
        return [per(i) for i in range(3)]

    def create_execution_context(self):
        self.contexts.append(FakeContext(self))
        return self.contexts[-1]


def trt_backend(monkeypatch, tmp_path, engine, precision="fp16", **kwargs) -> TrtBackend:
    trt = type(
        "Trt",
        (FakeTrt,),
        {"Runtime": lambda logger: SimpleNamespace(deserialize_cuda_engine=lambda b: engine)},
    )
    monkeypatch.setattr(trt_mod, "require_tensorrt", lambda: trt)
    (tmp_path / "engines").mkdir(exist_ok=True)
    (tmp_path / "engines" / f"base-{precision}.plan").write_bytes(b"PLAN")
    return TrtBackend(tmp_path, manifest(engine_precision=precision), **kwargs)


def calls(engine) -> Counter:
    return sum((c.calls for c in engine.contexts), Counter())


PER_SLOT = Counter(
    set_input_shape=len(INPUT_NAMES) + len(PAST),  # one full bind: shapes, then addresses
    set_tensor_address=len(INPUT_NAMES) + len(PAST) + len(PRESENT) + 2,
)


@pytest.mark.parametrize("kv, cuda_graphs", [("float16", True), ("float32", True), ("float16", False)])
def test_trt_steps_match_the_reference_and_replays_bind_nothing(cuda, monkeypatch, tmp_path, kv, cuda_graphs):
    engine = FakeEngine(cuda, getattr(FakeTrt, kv))
    backend = trt_backend(monkeypatch, tmp_path, engine, cuda_graphs=cuda_graphs)
    assert backend.kv_dtype == np.dtype(kv) and backend.name == "trt-fp16"
    reference, replays = Reference(np.dtype(kv)), 0
    for _generation in range(2):  # the second one replays the slots the first captured
        cache, ref_cache = backend.new_cache(1, 256), reference.new_cache(1, 256)
        assert cache.keys[0].dtype == np.dtype(kv)
        ours, theirs = decode(backend, cache), decode(reference, ref_cache)
        for i in range(len(STEPS) + 1):
            slots, before, launched = len(backend._slots), calls(engine), cuda.launches
            assert_same(next(ours), next(theirs))
            made, new = calls(engine) - before, len(backend._slots) - slots
            if i == 0 or not cuda_graphs:  # the prefill, or no graphs: throwaway buffers, bound once
                assert made == PER_SLOT and cuda.launches == launched
            else:  # a new slot is bound once; a replay sets nothing on the context
                assert made == Counter({k: new * v for k, v in PER_SLOT.items()})
                assert cuda.launches == launched + 1
                replays += not new
        assert cache.length == ref_cache.length
        for a, b in zip(cache.buffers(), ref_cache.buffers()):
            np.testing.assert_array_equal(host(cuda, a)[:, :, : cache.length], b[:, :, : cache.length])
    assert replays >= (28 if cuda_graphs else 0)
    backend.close()
    assert not cuda.live  # slots and the cache pool are freed


def test_trt_slot_rebinds_a_context_another_slot_used(cuda, monkeypatch, tmp_path):
    """Two uncaptured slots on one profile's context: each execution runs on its own buffers, and binds only
    when the context was last bound for the other slot."""
    engine = FakeEngine(cuda, FakeTrt.float32)
    backend = trt_backend(monkeypatch, tmp_path, engine)
    cache = backend.new_cache(1, 256)
    cache.length = 10
    past = cache.buffers()
    present = [backend.pool.partner(b) for b in past]

    def feed(parents, first):
        return tree_inputs(cache, parents, np.arange(len(parents)) + first)

    a_feed, b_feed = feed([-1, 0], 1), feed([-1, 0, 0], 5)
    a, b = _Slot(backend, 1, a_feed, past, present), _Slot(backend, 1, b_feed, past, present)
    context = backend.contexts[1]

    def run(slot, inputs):
        before = context.calls.copy()
        slot.load(inputs)
        slot.launch()
        want = Reference().step(
            inputs, KVCache([host(cuda, x) for x in past[::2]], [host(cuda, x) for x in past[1::2]], 10, None)
        )
        np.testing.assert_array_equal(host(cuda, slot.outputs[LOGITS]), want.logits)
        np.testing.assert_array_equal(host(cuda, slot.outputs[HIDDEN_STATES]), want.hidden_states)
        return context.calls - before

    assert run(b, b_feed) == Counter()  # b was bound last (at creation)
    assert run(a, a_feed) == PER_SLOT  # the context holds b's shapes and addresses: a puts its own back
    assert run(a, feed([-1, 0], 30)) == Counter()  # new values in a's buffers, nothing to bind
    b.free()
    assert backend.bound_slot[1] is a
    a.free()
    assert backend.bound_slot[1] is None
    backend.close()


def test_trt_bf16_cache_and_mixed_kv_dtypes(cuda, monkeypatch, tmp_path):
    backend = trt_backend(monkeypatch, tmp_path, FakeEngine(cuda, FakeTrt.bfloat16), precision="bf16")
    assert backend.name == "trt-bf16" and backend.kv_dtype == np.dtype(np.uint16)  # bf16 bit patterns
    assert backend.new_cache(1, 256).keys[0].nbytes == 256 * KV_HEADS * HEAD_DIM * 2
    backend.close()
    with pytest.raises(BundleError, match=r"mixes KV dtypes \(float16, float32\); rebuild it"):
        trt_backend(monkeypatch, tmp_path, FakeEngine(cuda, FakeTrt.float16, present_kv=FakeTrt.float32))
