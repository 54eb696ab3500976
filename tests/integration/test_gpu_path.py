"""The GPU path: what a CPU can check (profiles, buckets, padding rules, torch == ORT), and GPU tests marked
``gpu`` that skip without CUDA (run by ``scripts/gpu_check.sh``). Engine bookkeeping and the one-line errors
of a machine without a GPU are in test_gpu_engines.py."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
from specdeploy.runtime import backends
from specdeploy.runtime.backends.base import StepInputs
from specdeploy.runtime.backends.ort import OrtBackend, trt_ep_options
from specdeploy.runtime.backends.trt_profiles import (
    optimization_profiles,
    pick_profile,
)
from specdeploy.runtime.bundle import Limits, TensorSpec, read_manifest
from specdeploy.runtime.capture import (
    capacity_needed,
    pad_step,
    padded_tree_size,
    prepare_captured_step,
    should_capture,
    tree_buckets,
)
from specdeploy.runtime.decode import Decoder, GenerationConfig
from specdeploy.runtime.drafters import PromptLookupDrafter
from specdeploy.runtime.errors import BackendUnavailableError, BundleError
from specdeploy.runtime.kvcache import KVCache, capacity_buckets
from specdeploy.runtime.plan_choice import candidates
from specdeploy.runtime.probe import resolve_plan
from specdeploy.runtime.tree import build_buffers

torch = pytest.importorskip("torch")
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
needs_trt = pytest.mark.skipif(not (HAS_CUDA and importlib.util.find_spec("tensorrt")), reason="needs TensorRT")

# Prompt with repeats, so prompt lookup proposes multi-node trees.
PROMPT = [1, 504, 3458, 282, 253, 1345, 30, 504, 3458, 282, 253, 1345, 30, 504, 3458]


# --- profiles ---------------------------------------------------------------------------------------
def test_profiles_cover_prefill_and_tree():
    limits = Limits(max_batch=4, max_tree=64, max_context=2048)
    prefill, tree = optimization_profiles(limits)
    buckets = capacity_buckets(2048, 64)
    assert (prefill.name, tree.name) == ("prefill", "tree")
    assert (prefill.tree.min, prefill.tree.max) == (1, 2048) and prefill.tree.opt == 256
    assert (tree.tree.min, tree.tree.opt, tree.tree.max) == (1, 64, 64)
    for p in (prefill, tree):
        assert (p.batch.min, p.batch.opt, p.batch.max) == (1, 1, 4)
        assert (p.capacity.min, p.capacity.max) == (buckets[0], buckets[-1]) == (256, 2112)
        assert p.capacity.opt in buckets
    assert prefill.kept.max == 2048 and tree.kept.max == 64
    # Smaller build limits shrink the ranges; larger ones than the bundle's are refused.
    _, small = optimization_profiles(limits, max_tree=16, max_context=512, max_batch=1)
    assert small.tree.max == 16 and small.capacity.max == 528 and small.batch.max == 1
    with pytest.raises(BundleError, match="--max-tree 128 exceeds the bundle's limit of 64"):
        optimization_profiles(limits, max_tree=128)
    with pytest.raises(BundleError, match="--max-batch must be at least 1"):
        optimization_profiles(limits, max_batch=0)


def test_profile_shapes_and_selection():
    limits = Limits(max_batch=2, max_tree=32, max_context=1024)
    profiles = optimization_profiles(limits)
    past = TensorSpec("past_key_0", "float32", ("batch", 3, "capacity", 64))
    lo, opt, hi = profiles[1].shapes(past)
    assert lo == (1, 3, 256, 64) and hi == (2, 3, 1056, 64) and opt[2] in capacity_buckets(1024, 32)
    mask = TensorSpec("attention_mask", "float32", ("batch", 1, "tree", "capacity"))
    assert profiles[0].shapes(mask)[2] == (2, 1, 1024, 1056)
    with pytest.raises(BundleError, match="dynamic dimension 'seq'"):
        profiles[0].shapes(TensorSpec("x", "float32", ("seq",)))
    assert pick_profile(profiles, 1, 8, 512, 8) == 1  # a tree step: the tree profile
    assert pick_profile(profiles, 1, 300, 512, 1) == 0  # a long prompt: only prefill holds it
    with pytest.raises(BackendUnavailableError, match="No TensorRT optimization profile"):
        pick_profile(profiles, 3, 8, 512, 8)


def test_trt_ep_options_list_each_input_once_per_profile(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    opts = trt_ep_options(tiny_bundle, manifest, precision="fp16")
    n_inputs = len(manifest.graph("base").inputs)
    for key in ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes"):
        assert len(opts[key].split(",")) == 2 * n_inputs
    assert "input_ids:1x512" in opts["trt_profile_max_shapes"]  # prefill up to max_context
    assert opts["trt_fp16_enable"] == "1" and opts["trt_engine_cache_enable"] == "1"
    assert opts["trt_engine_cache_path"].startswith(str(tiny_bundle / "engines"))


# --- capture buckets and padding rules ----------------------------------------------------------------
def test_tree_buckets_and_capture_rules():
    assert tree_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert tree_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert tree_buckets(1) == (1,)
    b = tree_buckets(64)
    assert [padded_tree_size(n, b) for n in (1, 2, 3, 5, 17, 63, 64)] == [1, 2, 4, 8, 32, 64, 64]
    with pytest.raises(ValueError):
        padded_tree_size(65, b)
    assert should_capture(length=10, n=5, max_tree=64)
    assert not should_capture(length=0, n=5, max_tree=64)  # prefill
    assert not should_capture(length=10, n=65, max_tree=64)


def _step_inputs(length: int, parents: list[int], capacity: int, tokens=None) -> StepInputs:
    """A tree step laid out like the decoder does (slots length.., positions length + depth)."""
    buf = build_buffers(parents)
    n = len(parents)
    neg = np.finfo(np.float32).min
    mask = np.full((1, 1, n, capacity), neg, np.float32)
    mask[..., :length] = 0.0
    mask[0, 0, :, length:length + n] = np.where(buf.mask, 0.0, neg)
    ids = np.asarray(tokens if tokens is not None else 100 + np.arange(n), np.int64)[None]
    return StepInputs(ids, (length + buf.depth)[None].astype(np.int64), mask,
                      np.arange(length, length + n, dtype=np.int64), np.arange(n, dtype=np.int64))


def test_pad_step_layout():
    inputs = _step_inputs(10, [-1, 0, 0, 1, 2], capacity=16)
    assert capacity_needed(inputs, 10, 8) == 18
    with pytest.raises(ValueError, match="beyond capacity"):
        pad_step(inputs, 8, 10, 16)
    p = pad_step(inputs, 8, 10, 32)
    ins = p.inputs
    assert (p.n_real, p.k_real) == (5, 5) and (p.key.batch, p.key.capacity, p.key.t_pad) == (1, 32, 8)
    assert ins.input_ids.shape == (1, 8) and ins.attention_mask.shape == (1, 1, 8, 32)
    np.testing.assert_array_equal(ins.write_indices, np.arange(10, 18))  # padded rows: fresh slots after the tree
    visible = ins.attention_mask[0, 0] == 0.0  # [T_pad, C]
    np.testing.assert_array_equal(visible[:5, :16], inputs.attention_mask[0, 0] == 0.0)  # real rows unchanged
    assert not visible[:5, 15:].any()  # ...and blind to the padded slots and the grown columns
    for j in range(5, 8):  # a padded row sees exactly its own slot
        assert np.flatnonzero(visible[j]).tolist() == [10 + j]
    assert (ins.input_ids[0, 5:] == inputs.input_ids[0, 0]).all()
    assert (ins.position_ids[0, 5:] == inputs.position_ids.max()).all()
    assert len(ins.logits_index) == 8 and (ins.logits_index[5:] == 0).all()


def _clone(cache: KVCache) -> KVCache:
    return KVCache([k.copy() for k in cache.keys], [v.copy() for v in cache.values], cache.length, cache.allocate)


def _prefilled(backend, prompt: list[int], capacity: int) -> KVCache:
    cache = backend.new_cache(1, capacity)
    n = len(prompt)
    causal = _step_inputs(0, list(range(-1, n - 1)), capacity, tokens=prompt)
    backend.step(causal, cache)
    cache.length = n
    return cache


def _check_padded_equals_unpadded(backend, manifest):
    """A padded step gives the real rows the same logits, hidden states and cache rows as the unpadded one."""
    cache = _prefilled(backend, PROMPT[:10], capacity=16)
    inputs = _step_inputs(10, [-1, 0, 0, 1, 2], capacity=16, tokens=[3458, 282, 30, 253, 1345])
    plain_cache, pad_cache = _clone(cache), _clone(cache)
    plain = backend.step(inputs, plain_cache)
    buckets = capacity_buckets(manifest.limits.max_context, manifest.limits.max_tree)
    # Leftover garbage in the padded rows' slots must not matter (they are never read as valid).
    padded = prepare_captured_step(inputs, pad_cache, tree_buckets(manifest.limits.max_tree), buckets)
    assert padded is not None and padded.key.t_pad == 8 and pad_cache.capacity == buckets[0] > 16
    for buf in pad_cache.buffers():
        buf[:, :, 15:] = np.random.default_rng(0).standard_normal(buf[:, :, 15:].shape)
    out = backend.step(padded.inputs, pad_cache)
    np.testing.assert_allclose(out.logits[:, :padded.k_real], plain.logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out.hidden_states[:, :padded.n_real], plain.hidden_states, atol=1e-4, rtol=1e-4)
    assert (out.logits[0, :5].argmax(-1) == plain.logits[0].argmax(-1)).all()
    for a, b in zip(plain_cache.buffers(), pad_cache.buffers()):
        np.testing.assert_allclose(np.asarray(b[:, :, :15]), np.asarray(a[:, :, :15]), atol=1e-5)
        assert np.isfinite(np.asarray(b)).all()


def test_padded_step_matches_unpadded_on_ort(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    with OrtBackend(tiny_bundle, manifest, threads=2) as backend:
        _check_padded_equals_unpadded(backend, manifest)


@pytest.fixture(scope="module")
def torch_cpu(tiny_bundle):
    from specdeploy.exporter.reference.torch_backend import TorchBackend

    manifest = read_manifest(tiny_bundle)
    with TorchBackend(tiny_bundle, manifest, device="cpu", cuda_graphs=False, threads=2) as backend:
        yield backend


def test_padded_step_matches_unpadded_on_torch_cpu(torch_cpu, tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    # Torch tensors support the same slicing; compare through numpy views of the CPU buffers.
    cache = _prefilled(torch_cpu, PROMPT[:10], capacity=16)
    inputs = _step_inputs(10, [-1, 0, 0, 1, 2], capacity=16, tokens=[3458, 282, 30, 253, 1345])

    def clone(c: KVCache) -> KVCache:
        return KVCache([k.clone() for k in c.keys], [v.clone() for v in c.values], c.length, c.allocate)

    plain_cache, pad_cache = clone(cache), clone(cache)
    plain = torch_cpu.step(inputs, plain_cache)
    buckets = capacity_buckets(manifest.limits.max_context, manifest.limits.max_tree)
    padded = prepare_captured_step(inputs, pad_cache, tree_buckets(manifest.limits.max_tree), buckets)
    out = torch_cpu.step(padded.inputs, pad_cache)
    np.testing.assert_allclose(out.logits[:, :padded.k_real], plain.logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out.hidden_states[:, :padded.n_real], plain.hidden_states, atol=1e-4, rtol=1e-4)
    for a, b in zip(plain_cache.buffers(), pad_cache.buffers()):
        torch.testing.assert_close(b[:, :, :15], a[:, :, :15], atol=1e-5, rtol=1e-5)


# --- torch reference backend == ORT on the CPU ---------------------------------------------------------
def _greedy(backend, manifest, drafter=None, n: int = 24) -> list[int]:
    plan = resolve_plan(backend, manifest, use_cache=False)
    return list(Decoder(backend, manifest, drafter, plan=plan).generate(PROMPT, GenerationConfig(max_new_tokens=n)))


def test_torch_eager_cpu_matches_ort_greedy(torch_cpu, tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    with OrtBackend(tiny_bundle, manifest, threads=2) as ort_backend:
        ref = _greedy(ort_backend, manifest)
        ref_pl = _greedy(ort_backend, manifest, PromptLookupDrafter())
        prefill = ort_backend.step(_step_inputs(0, list(range(-1, 9)), 256, PROMPT[:10]),
                                   ort_backend.new_cache(1, 256))
    assert ref == ref_pl
    assert _greedy(torch_cpu, manifest) == ref
    assert _greedy(torch_cpu, manifest, PromptLookupDrafter()) == ref
    got = torch_cpu.step(_step_inputs(0, list(range(-1, 9)), 256, PROMPT[:10]), torch_cpu.new_cache(1, 256))
    np.testing.assert_allclose(got.logits, prefill.logits, atol=1e-3, rtol=1e-3)


def test_torch_gathered_trees_equal_plain_on_cpu(torch_cpu, tiny_bundle):
    """The torch form of the exact-tree plan (BaseStep.gathered): the probe finds its trees exact, and random
    trees through arbitrary branches decode as plain decoding does on that plan."""
    from decode_checks import OracleDrafter
    from specdeploy.runtime.plan import StepPlan
    from specdeploy.runtime.probe import probe

    manifest = read_manifest(tiny_bundle)
    tree_plans = [c for c in candidates(torch_cpu, 16) if c.gathered]
    assert [c.name for c in tree_plans] == ["gathered", "gathered-two-rows", "gathered-padded-16"]
    results = [probe(torch_cpu, manifest, c, 16) for c in tree_plans]
    # the padded one runs every step at 16 rows, so no kernel sees another row count (torch's CPU GEMMs
    # may pick others by rows, as here for the 1-row plan's chains): its trees are exact by construction
    assert results[-1].trees_exact, results[-1].checks
    exact = next(r.candidate for r in results if r.trees_exact)
    plan = StepPlan(exact, True, True, True, 16, "forced")
    ref = list(Decoder(torch_cpu, manifest, None, plan=plan).generate(PROMPT, GenerationConfig(24)))
    got = list(Decoder(torch_cpu, manifest, OracleDrafter(len(PROMPT), ref, max_nodes=16), plan=plan)
               .generate(PROMPT, GenerationConfig(24)))
    assert got == ref and torch_cpu.step_module.gathered
    torch_cpu.use_gathered(False)


def test_torch_backend_refuses_cuda_graphs_on_cpu(tiny_bundle):
    from specdeploy.exporter.reference.torch_backend import TorchBackend

    if HAS_CUDA:
        pytest.skip("this machine has CUDA")
    with pytest.raises(BackendUnavailableError, match="CUDA graphs need a CUDA GPU"):
        TorchBackend(tiny_bundle, read_manifest(tiny_bundle), device="cpu", cuda_graphs=True)
    with pytest.raises(BackendUnavailableError, match="PyTorch sees no CUDA GPU"):
        TorchBackend(tiny_bundle, read_manifest(tiny_bundle), device="cuda")


# --- GPU (skipped without CUDA; scripts/gpu_check.sh runs them) ------------------------------------------
@pytest.mark.gpu
@needs_cuda
def test_torch_cuda_graphs_match_eager_and_ort(tiny_bundle):
    from specdeploy.exporter.reference.torch_backend import TorchBackend

    manifest = read_manifest(tiny_bundle)
    with OrtBackend(tiny_bundle, manifest, threads=2) as ort_backend:
        ref = _greedy(ort_backend, manifest, n=48)
    with TorchBackend(tiny_bundle, manifest, device="cuda", cuda_graphs=False) as eager:
        assert _greedy(eager, manifest, n=48) == ref
        assert _greedy(eager, manifest, PromptLookupDrafter(), n=48) == ref
    with TorchBackend(tiny_bundle, manifest, device="cuda", cuda_graphs=True) as graphs:
        assert _greedy(graphs, manifest, n=48) == ref
        assert _greedy(graphs, manifest, PromptLookupDrafter(), n=48) == ref
        assert _greedy(graphs, manifest, PromptLookupDrafter(), n=48) == ref  # replays across generations
        assert graphs._graphs, "decode steps should have been captured"


@pytest.mark.gpu
@needs_cuda
def test_torch_cuda_gathered_trees_are_exact(tiny_bundle):
    """On the GPU, with CUDA graphs: the probe's verdict on the exact-tree plans, and where one is exact, random
    trees decode as plain decoding does on it."""
    from decode_checks import OracleDrafter
    from specdeploy.exporter.reference.torch_backend import TorchBackend
    from specdeploy.runtime.plan_choice import choose

    manifest = read_manifest(tiny_bundle)
    with TorchBackend(tiny_bundle, manifest, device="cuda", cuda_graphs=True) as backend:
        chosen = resolve_plan(backend, manifest, use_cache=False)
        tree_plans = [r for r in chosen.probes if r.candidate.gathered]
        assert tree_plans or chosen.trees, chosen.reason  # probed, unless a plain plan's trees are exact already
        exact = [r for r in tree_plans if r.trees_exact]
        if not exact:
            pytest.skip(f"no exact-tree plan on this GPU: {chosen.reason}")
        plan = choose([exact[0]], 16)
        ref = list(Decoder(backend, manifest, None, plan=plan).generate(PROMPT, GenerationConfig(48)))
        got = list(Decoder(backend, manifest, OracleDrafter(len(PROMPT), ref, max_nodes=16), plan=plan)
                   .generate(PROMPT, GenerationConfig(48)))
        assert got == ref


@pytest.mark.gpu
@needs_cuda
def test_torch_cuda_padded_step_matches_unpadded(tiny_bundle):
    from specdeploy.exporter.reference.torch_backend import TorchBackend

    manifest = read_manifest(tiny_bundle)
    with TorchBackend(tiny_bundle, manifest, device="cuda", cuda_graphs=True) as backend:
        cache = backend.new_cache(1, 256)
        backend.step(_step_inputs(0, list(range(-1, 9)), 256, PROMPT[:10]), cache)
        cache.length = 10
        inputs = _step_inputs(10, [-1, 0, 0, 1, 2], 256, tokens=[3458, 282, 30, 253, 1345])
        snapshot = [b.clone() for b in cache.buffers()]
        graph_out = backend.step(inputs, cache)  # padded to 8 and replayed
        for buf, saved in zip(cache.buffers(), snapshot):
            buf.copy_(saved)
        backend.cuda_graphs = False
        eager_out = backend.step(inputs, cache)
    np.testing.assert_allclose(graph_out.logits, eager_out.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not importlib.util.find_spec("onnxruntime") or "CUDAExecutionProvider" not in
                    __import__("onnxruntime").get_available_providers(), reason="needs onnxruntime-gpu")
def test_ort_cuda_graph_backend_matches_cpu(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    with OrtBackend(tiny_bundle, manifest, threads=2) as ort_backend:
        ref = _greedy(ort_backend, manifest, PromptLookupDrafter())
    with backends.make_backend("ort-cuda", tiny_bundle, manifest) as gpu:
        assert _greedy(gpu, manifest, PromptLookupDrafter()) == ref


@pytest.mark.gpu
@needs_trt
def test_trt_build_validate_and_decode(tiny_bundle, tmp_path):
    from specdeploy.exporter.build.trt import BuildConfig, build_engines
    from specdeploy.exporter.check.trt import validate_backend

    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    build_engines(bundle, BuildConfig("fp32", max_context=256), progress=print)
    manifest = read_manifest(bundle)
    assert manifest.engines and Path(bundle / manifest.engines[0].file).is_file()
    validate_backend(bundle, "trt", progress=print)
    with OrtBackend(bundle, manifest, threads=2) as ort_backend:
        ref = _greedy(ort_backend, manifest, PromptLookupDrafter())
    with backends.make_backend("trt", bundle, manifest) as trt_backend:
        assert _greedy(trt_backend, manifest, PromptLookupDrafter()) == ref
