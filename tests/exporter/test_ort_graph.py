"""The ``ort`` graph target (``exporter/export/ort_graph.py``): parity with torch, bundles with two targets,
the runtime's choice of graph, and greedy identity on it.

Parity runs the graph the way the runtime does: the cache buffers are bound as both ``past_*`` and
``present_*`` (GroupQueryAttention then writes in place), and the presents are
compared over the valid ``past + T`` slots, which is all a step may touch.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from specdeploy.runtime import load
from specdeploy.runtime.bundle import TREE_TARGET, read_manifest
from specdeploy.runtime.contract import present_names
from specdeploy.runtime.decode import Decoder, GenerationConfig
from specdeploy.runtime.errors import BundleError

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "one two three four one two three four one two",
    "The cat sat on the mat. The cat sat on the",
]


def _run_aliased(path, feed: dict[str, np.ndarray]):
    """One step with every present bound to its past buffer, as ``OrtBackend`` runs it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    past = {k: v.copy() for k, v in feed.items() if k.startswith("past_")}
    for k, v in feed.items():
        if not k.startswith("past_"):
            binding.bind_cpu_input(k, v)
    binding.bind_output("logits")
    binding.bind_output("hidden_states")
    for k, v in past.items():
        ov = ort.OrtValue.ortvalue_from_numpy(v)
        binding.bind_ortvalue_input(k, ov)
        binding.bind_ortvalue_output(k.replace("past_", "present_"), ov)
    sess.run_with_iobinding(binding)
    logits, hidden = (o.numpy() for o in binding.get_outputs()[:2])
    return logits, hidden, past


def _batch_of_three(feed: dict[str, np.ndarray], vocab: int) -> dict[str, np.ndarray]:
    """``feed`` (batch 1) as row 0 of a batch of three whose other rows hold other tokens and caches."""
    rng = np.random.default_rng(1)
    out = {}
    for k, v in feed.items():
        if k in ("write_indices", "logits_index"):
            out[k] = v
        elif k == "input_ids":
            out[k] = np.concatenate([v, rng.integers(0, vocab, (2, v.shape[1]))])
        elif k.startswith("past_"):
            out[k] = np.concatenate([v, rng.standard_normal((2, *v.shape[1:])).astype(v.dtype)])
        else:
            out[k] = np.concatenate([v] * 3)
    return out


@pytest.mark.parametrize("arch,attention", [("llama", "fused"), ("mistral", "fused"), ("qwen2", "fused"),
                                            ("llama", "gathered"), ("qwen2", "gathered")])
def test_ort_graph_parity(arch, attention, tiny_model_factory, tmp_path):
    """Every attention form against torch on prefill, step and tree; the gathered form (which batching runs) on a
    batch of three one-row steps as well, whose row 0 is the batch-1 step."""
    import torch
    from specdeploy.exporter.check.validate import _FlatStep, base_cases
    from specdeploy.exporter.export.base import model_config
    from specdeploy.exporter.export.ort_graph import build_ort_graph, save_graph
    from specdeploy.exporter.source import load_model
    from specdeploy.graphs.base_step import BaseStep

    loaded = load_model(str(tiny_model_factory(arch)))
    step = BaseStep(loaded.model).eval()
    model = build_ort_graph(step, max_positions=128, attention=attention)
    ops = {n.op_type for n in model.graph.node}
    assert "SkipSimplifiedLayerNormalization" in ops and "Split" in ops
    assert ("GroupQueryAttention" in ops) != (attention == "gathered")  # the gathered form: standard products
    assert ("ReduceMax" in ops) == (attention == "gathered")  # the batch's longest row
    save_graph(model, tmp_path / "base.onnx")

    class _Manifest:  # base_cases reads only the model config
        model = model_config(loaded.model, loaded.tokenizer, arch)

    flat = _FlatStep(step)
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog again")["input_ids"][:12]
    cases = base_cases(_Manifest, flat, list(ids))
    if attention == "gathered":  # several sequences of one row each
        cases += [(case + " x3", _batch_of_three(feed, _Manifest.model.vocab_size)) for case, feed in cases
                  if feed["input_ids"].shape[1] == 1]
    for case, feed in cases:
        with torch.no_grad():
            ref = [o.numpy() for o in flat(**{k: torch.from_numpy(v) for k, v in feed.items()})]
        logits, hidden, past = _run_aliased(tmp_path / "base.onnx", feed)
        valid = int(feed["write_indices"][-1]) + 1
        assert np.abs(logits - ref[0]).max() < 1e-4, case
        assert (logits.argmax(-1) == ref[0].argmax(-1)).all(), case
        assert np.abs(hidden - ref[1]).max() < 1e-4, case
        for name, want in zip(present_names(step.num_layers), ref[2:]):
            got = past[name.replace("present_", "past_")]
            assert np.abs(got[:, :, :valid] - want[:, :, :valid]).max() < 1e-4, (case, name)
        if case == "tree":  # the tree case branches: a plain causal mask would fail these rows
            assert feed["attention_mask"][0, 0, 2, valid - 6] < -1e30


@pytest.mark.parametrize("rows", [1, 3])
def test_the_gathered_graph_keeps_each_row_at_its_own_columns(rows, tiny_model_factory, tmp_path):
    """The graph that takes several sequences (the gathered one, with one row each or a chain of several): three
    sequences of other lengths in one step, each at its own columns (row b's write_indices shifted by its
    position's offset from row 0's), equal each sequence's step alone, and write nowhere else."""
    from specdeploy.exporter.export.ort_graph import build_ort_graph, save_graph
    from specdeploy.exporter.source import load_model
    from specdeploy.graphs.base_step import BaseStep

    step = BaseStep(load_model(str(tiny_model_factory("llama"))).model).eval()
    save_graph(build_ort_graph(step, max_positions=128, attention="gathered"), tmp_path / "b.onnx")
    rng = np.random.default_rng(0)
    cap, lengths = 48, np.array([20, 7, 33])
    toks = np.array([[11, 12, 13], [22, 23, 24], [33, 34, 35]])[:, :rows]
    past = {f"past_{k}_{i}": rng.standard_normal((3, step.num_kv_heads, cap, step.head_dim)).astype(np.float32)
            for i in range(step.num_layers) for k in ("key", "value")}
    neg = np.finfo(np.float32).min

    def feed(seqs: list[int]) -> dict[str, np.ndarray]:
        n = lengths[seqs]
        pos = n[:, None] + np.arange(rows)  # [B, T]: a chain, each row at its own column
        mask = np.where(np.arange(cap)[None, None, None, :] <= pos[:, None, :, None], 0.0, neg).astype(np.float32)
        return {"input_ids": toks[seqs], "position_ids": pos, "attention_mask": mask,
                "write_indices": pos[0], "logits_index": np.arange(rows),
                **{k: v[seqs].copy() for k, v in past.items()}}

    logits, hidden, caches = _run_aliased(tmp_path / "b.onnx", feed([0, 1, 2]))
    for r in range(3):
        lone_logits, lone_hidden, lone_caches = _run_aliased(tmp_path / "b.onnx", feed([r]))
        np.testing.assert_allclose(logits[r], lone_logits[0], atol=1e-5)
        np.testing.assert_allclose(hidden[r], lone_hidden[0], atol=1e-5)
        for k, v in past.items():
            np.testing.assert_allclose(caches[k][r], lone_caches[k][0], atol=1e-6)
            written = np.flatnonzero((caches[k][r] != v[r]).any(axis=(0, 2)))
            assert written.tolist() == list(range(lengths[r], lengths[r] + rows)), (k, r)  # its own columns only


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_padded_attention_is_recorded_and_one_row_steps_match_two_row_steps(precision, tiny_model_factory, tmp_path):
    """The padded attention: the graph records it (``attention_rows`` 2), leaves the past untouched and
    computes a 1-row step as row 0 of a 2-row step up to rounding. Whether bit for bit is the CPU's
    kernels' business (measured at load by ``runtime/plan.py``, not asserted here): an AVX-512 Xeon
    gave 0 with the padding, an AVX2 EPYC 7.7e-07 on int4."""
    from specdeploy.exporter.export.ort_graph import ATTENTION_ROWS_KEY, build_ort_graph, save_graph
    from specdeploy.exporter.export.quantize import quant_config, quantize_model
    from specdeploy.exporter.source import load_model
    from specdeploy.graphs.base_step import BaseStep

    step = BaseStep(load_model(str(tiny_model_factory("llama"))).model).eval()
    m = step
    rng = np.random.default_rng(0)
    cap, p = 64, 40
    past = {f"past_{k}_{i}": rng.standard_normal((1, m.num_kv_heads, cap, m.head_dim)).astype(np.float32)
            for i in range(m.num_layers) for k in ("key", "value")}

    def feed(t: int) -> dict[str, np.ndarray]:
        mask = np.full((1, 1, t, cap), np.finfo(np.float32).min, np.float32)
        mask[..., :p] = 0.0
        mask[0, 0, :, p : p + t] = np.where(np.tril(np.ones((t, t), bool)), 0.0, mask.min())
        return {"input_ids": np.array([[11, 22][:t]]), "position_ids": np.arange(p, p + t)[None],
                "attention_mask": mask, "write_indices": np.arange(p, p + t), "logits_index": np.arange(t),
                **{k: v.copy() for k, v in past.items()}}

    gaps = {}
    for pad in (True, False):
        model = build_ort_graph(step, max_positions=128, pad_attention=pad)
        if precision == "int4":
            model = quantize_model(model, quant_config("int4"))
        rows = {q.key: q.value for q in model.metadata_props}.get(ATTENTION_ROWS_KEY)
        assert rows == ("2" if pad else None)
        save_graph(model, tmp_path / f"{pad}.onnx")
        (l1, h1, c1), (l2, h2, c2) = (_run_aliased(tmp_path / f"{pad}.onnx", feed(t)) for t in (1, 2))
        gaps[pad] = max(np.abs(l1[0, 0] - l2[0, 0]).max(), np.abs(h1[0, 0] - h2[0, 0]).max(),
                        max(np.abs(c1[k][:, :, p] - c2[k][:, :, p]).max() for k in past))
        np.testing.assert_array_equal(c1["past_key_0"][:, :, :p], past["past_key_0"][:, :, :p])  # past untouched
    tol = 1e-4 if precision == "fp32" else 1.0  # int8 activations requantize: near-ties may round apart
    assert max(gaps.values()) < tol, gaps


def test_bundle_has_both_targets_and_runtime_prefers_ort(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    bases = {g.target: g for g in manifest.graphs if g.role == "base"}
    assert set(bases) == {"trt", "ort", TREE_TARGET}
    assert bases["trt"].file == "base.onnx" and bases["ort"].file == "base-ort.onnx"
    assert manifest.tree_graph().file == "base-tree.onnx" and not (tiny_bundle / "base-batch.onnx").exists()
    fused = onnx.load(str(tiny_bundle / "base-ort.onnx"), load_external_data=False)
    assert any(n.op_type == "GroupQueryAttention" for n in fused.graph.node)
    for other in ("ort", TREE_TARGET):  # one contract, three graphs
        assert bases[other].inputs == bases["trt"].inputs
        assert [s.name for s in bases[other].outputs] == [s.name for s in bases["trt"].outputs]
    assert bases[TREE_TARGET].data_files == ("base-ort.onnx.data",)  # the exact-tree graph's weights: stored once
    assert bases[TREE_TARGET].rows_apart and not bases["ort"].rows_apart  # the one that takes several sequences
    with load(tiny_bundle, draft=None) as engine:
        assert engine.backend.graph.file == "base-ort.onnx"


def test_greedy_and_speculative_identity_on_ort_graph(tiny_bundle):
    """Plain greedy on the fused graph matches the traced graph, and speculative matches plain."""
    cfg = GenerationConfig(max_new_tokens=24)
    from specdeploy.runtime.backends.ort import OrtBackend
    from specdeploy.runtime.probe import resolve_plan

    manifest = read_manifest(tiny_bundle)
    with load(tiny_bundle, draft=None) as fused, load(tiny_bundle, draft="prompt-lookup") as spec, \
            OrtBackend(tiny_bundle, manifest, graph=manifest.graph("base", "trt")) as traced_backend:
        traced = Decoder(traced_backend, manifest, plan=resolve_plan(traced_backend, manifest, use_cache=False))
        for prompt in PROMPTS:
            ids = fused.encode(prompt)
            plain = fused.generate_ids(ids, cfg)
            assert list(traced.generate(ids, cfg)) == plain
            assert spec.generate_ids(ids, cfg) == plain


def test_ort_only_bundle(tiny_model_factory, tmp_path):
    """--target ort skips the trace; TensorRT paths then say what is missing in one sentence."""
    from specdeploy.exporter.check.lint import lint_bundle
    from specdeploy.exporter.export.base import export_base

    out = tmp_path / "ort-only"
    export_base(str(tiny_model_factory("llama")), out, max_context=256, target="ort", progress=lambda m: None)
    assert not (out / "base.onnx").exists()
    manifest = read_manifest(out)
    assert [(g.role, g.target) for g in manifest.graphs] == [("base", "ort"), ("base", TREE_TARGET)]
    with pytest.raises(BundleError, match="no 'base' graph for target 'trt'.*--target all"):
        manifest.graph("base", "trt")
    assert all(r.skipped for r in lint_bundle(out))
    with load(out, draft=None) as engine:
        assert len(engine.generate_ids(engine.encode(PROMPTS[0]), GenerationConfig(8))) == 8
    with load(out, draft=None, max_batch=2) as engine:  # batching needs no traced graph (where rows batch here)
        assert engine.max_batch == (2 if engine.plan.rows else 1) and engine.backend.can_batch_rows
        assert len(engine.generate(PROMPTS[0], max_new_tokens=8).token_ids) == 8


# --- the GGUF's own blocks ---------------------------------------------------------------------------
_FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def _random_blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random bytes of an [n, k] weight in GGUF format ``kind`` (its fp16 fields made finite scales),
    and gguf's own dequantization of them (what transformers loads)."""
    from gguf import GGMLQuantizationType, quants
    from specdeploy.exporter.export.gguf_blocks import FORMATS

    values, size, _ = FORMATS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for offset in _FP16_FIELDS[kind]:
        scales = rng.uniform(0.001, 0.01, (n, k // values)).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(n, k // values, 2)
    raw = raw.reshape(n, -1)
    return raw, quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)


def _session(g, inputs: dict[str, list], outputs: dict[str, list]):
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from specdeploy.exporter.export.ort_graph import MS

    types = {"ids": TensorProto.INT64}
    graph = helper.make_graph(
        g.nodes, "blocks", [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), d) for n, d in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in outputs.items()], initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_gguf_blocks_decode_like_gguf(kind):
    from specdeploy.exporter.export.gguf_blocks import _exact, parse

    raw, want = _random_blocks(kind, 24, 512)
    blocks = parse(raw, kind, 24, 512)
    assert np.array_equal(blocks.dequantize(), want)  # bit for bit, as transformers loads it
    assert blocks.bits in (4, 8) and blocks.q.max() < 2 ** blocks.bits
    perm = np.random.default_rng(1).permutation(24)
    assert np.array_equal(blocks.rows(perm).dequantize(), want[perm])
    assert np.array_equal(_exact(blocks, want[perm], perm).dequantize(), want[perm])  # kept, in that order
    assert _exact(blocks, want[perm]) is None  # rows in another order than asked refuse
    assert _exact(blocks, want + 1e-3) is None  # a weight that does not decode exactly refuses
    if kind.endswith("_K"):  # a K-quant needs whole super-blocks of 256 along K
        assert parse(raw, kind, 96, 128) is None
    assert parse(raw, "Q2_K", 24, 512) is None  # a format MatMulNBits cannot hold


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("t, accuracy", [(1, 0), (5, 0), (1, 4), (5, 4)])
def test_block_linear_matches_the_dequantized_weights(kind, t, accuracy):
    """MatMulNBits (plus the block-minimum Gemm for Q4_1/Q4_K) equals x @ W.T on flat rows ``[t, K]`` to fp32
    rounding (accuracy level 0), or to the rounding of x to int8 per block (level 4, the ``gguf`` precision);
    two weights of different layouts (Q8_0 beside Q5_0, as Qwen's v_proj) go as two nodes, concatenated."""
    from specdeploy.exporter.export.gguf_blocks import parse
    from specdeploy.exporter.export.ort_graph import _Builder, blocks_linear

    n, k = 40, 256
    raw, w = _random_blocks(kind, n, k, seed=2)
    other_raw, other = _random_blocks("Q8_0" if kind != "Q8_0" else "Q5_0", 8, k, seed=4)
    g = _Builder()
    parts = [parse(raw, kind, n, k), parse(other_raw, "Q8_0" if kind != "Q8_0" else "Q5_0", 8, k)]
    y = blocks_linear(g, "x", "w", parts, accuracy)
    g.op("Identity", [y], outputs=["y"])
    sess = _session(g, {"x": ["t", k]}, {"y": ["t", n + 8]})
    x = np.random.default_rng(3).normal(0, 1, (t, k)).astype(np.float32)
    got = sess.run(None, {"x": x})[0]
    want = x.astype(np.float64) @ np.concatenate([w, other]).T.astype(np.float64)
    assert np.abs(got - want).max() < (1e-4 if accuracy == 0 else 2e-2) * np.abs(want).max()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_embedding_rows_decode_exactly(kind):
    """The embedding held as packed integers and block scales gives bit for bit the dequantized rows, for
    repeated and out-of-order ids, in a fraction of the fp32 table's bytes."""
    from specdeploy.exporter.export.gguf_blocks import parse
    from specdeploy.exporter.export.ort_graph import _Builder, embedding_rows

    v, h = 64, 512
    raw, table = _random_blocks(kind, v, h, seed=6)
    g = _Builder()
    g.op("Identity", [embedding_rows(g, "ids", parse(raw, kind, v, h))], outputs=["rows"])
    stored = sum(np.prod(t.dims) * {2: 1, 10: 2, 1: 4}[t.data_type] for t in g.inits if len(t.dims) == 2)
    assert stored < 0.35 * table.nbytes
    ids = np.array([5, 0, 63, 5, 17])
    got = _session(g, {"ids": ["r"]}, {"rows": ["r", h]}).run(None, {"ids": ids})[0]
    assert np.array_equal(got, table[ids])


def test_requantize_holds_what_no_block_can():
    from specdeploy.exporter.export.gguf_blocks import REQUANTIZED, requantize

    w = np.random.default_rng(7).normal(0, 0.05, (16, 64)).astype(np.float32)
    blocks = requantize(w)
    assert blocks.kind == REQUANTIZED and blocks.bits == 8
    assert np.abs(blocks.dequantize() - w).max() <= np.abs(w).max() / 127 / 2 + 1e-7


@pytest.mark.parametrize("accuracy", [0, 4])
def test_gguf_block_graph_on_flat_rows_keeps_the_step_contract(accuracy, tiny_model_factory, tmp_path):
    """The GGUF-block graph (each linear's minima one Gemm onto its MatMulNBits, the layers on flat
    ``[B*T, H]`` rows) gives the contract's shapes and torch's numbers on the same weights: logits, hidden
    and layer states and the K/V rows, for a prefill, a step and a tree; int8 activations (level 4) to
    their rounding."""
    from collections import Counter

    import torch
    from specdeploy.exporter.check.validate import _FlatStep, base_cases
    from specdeploy.exporter.export.base import model_config
    from specdeploy.exporter.export.gguf_blocks import _GGUF_LINEARS, BLOCK, Blocks
    from specdeploy.exporter.export.ort_graph import build_ort_graph, save_graph
    from specdeploy.exporter.source import load_model
    from specdeploy.graphs.base_step import BaseStep

    loaded = load_model(str(tiny_model_factory("llama")))
    rng = np.random.default_rng(5)
    blocks = {}
    for i in range(loaded.model.config.num_hidden_layers):  # random Q4_1 blocks, and the model holds them
        for module in _GGUF_LINEARS.values():
            name = f"model.layers.{i}.{module}"
            linear = loaded.model.get_submodule(name)
            n, k = linear.weight.shape
            d = rng.uniform(0.01, 0.03, (n, k // BLOCK)).astype(np.float16).astype(np.float32)
            m = (-8 * d * rng.uniform(0.8, 1.2, d.shape)).astype(np.float16).astype(np.float32)
            blocks[name] = Blocks(rng.integers(0, 16, (n, k), dtype=np.uint8), d, m, 0, 4, BLOCK, "Q4_1")
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(blocks[name].dequantize()))
    step = BaseStep(loaded.model, feature_layers=(0,)).eval()
    graph = build_ort_graph(step, max_positions=128, blocks=blocks, block_accuracy=accuracy)
    ops = Counter(n.op_type for n in graph.graph.node)
    assert ops["MatMulNBits"] == ops["Gemm"] == 4 * step.num_layers and ops["MatMul"] == 1  # + the lm_head
    save_graph(graph, tmp_path / "q4.onnx")

    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "q4.onnx"), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in sess.get_outputs()]

    class _Manifest:  # base_cases reads only the model config
        model = model_config(loaded.model, loaded.tokenizer, "llama")

    flat = _FlatStep(step)

    def without_layer_states(**kw):  # base_cases chains the presents, which follow logits and hidden states
        out = flat(**kw)
        return (*out[:2], *out[3:])

    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog again")["input_ids"][:12]
    for case, feed in base_cases(_Manifest, without_layer_states, list(ids)):
        with torch.no_grad():
            ref = dict(zip(outputs, (o.numpy() for o in flat(**{k: torch.from_numpy(v) for k, v in feed.items()}))))
        got = dict(zip(outputs, sess.run(None, feed)))
        valid = int(feed["write_indices"][-1]) + 1
        shape = (1, feed["input_ids"].shape[1], step.embed_tokens.weight.shape[1])  # [B, T, H]
        assert got["hidden_states"].shape == shape and got["layer_states"].shape == shape
        for name, want in ref.items():
            have = got[name][:, :, :valid] if name.startswith("present") else got[name]
            want = want[:, :, :valid] if name.startswith("present") else want
            bound = 1e-4 if accuracy == 0 else 0.15  # int8 activations: a few % of the largest value
            assert np.abs(have - want).max() < bound * max(1.0, np.abs(want).max()), (case, name)


def test_cpu_graph_choice_plain_and_speculative(tiny_bundle):
    """Plain decoding takes the GGUF-block graph when there is one; tree steps take the fp32 fused one."""
    import dataclasses

    from specdeploy.runtime.precision import GGUF_Q4_1_BLOCKS

    manifest = read_manifest(tiny_bundle)
    fused = manifest.graph("base", "ort")
    traced = manifest.graph("base", "trt")
    blocks = dataclasses.replace(fused, file="base-q4.onnx", precision=GGUF_Q4_1_BLOCKS)
    three = manifest.replace(graphs=(traced, fused, blocks))
    assert three.cpu_base(multi_row=False) is blocks
    assert three.cpu_base(multi_row=True) is fused
    assert manifest.cpu_base(False) is fused and manifest.cpu_base(True) is fused  # no block graph: one choice
    traced_only = manifest.replace(graphs=(traced,))
    assert traced_only.cpu_base(False) is traced and traced_only.cpu_base(True) is traced


def test_two_graph_backend_routes_steps_by_rows(tiny_bundle, tmp_path, monkeypatch):
    """With a GGUF-block graph in the bundle, 1-row steps run it and prefill/tree steps the fp32 graph,
    on the same cache buffers; outputs stay those of the single-graph backend (here both graphs are
    the same fp32 graph under two names)."""
    import shutil

    from specdeploy.runtime import plan_choice

    monkeypatch.setattr(plan_choice, "GATHERED_MAX_COST", 0.0)  # the split plan, not the exact-tree one (test_gathered.py)

    from specdeploy.exporter.export.staging import graph_entry
    from specdeploy.runtime.bundle import write_manifest
    from specdeploy.runtime.precision import GGUF_Q4_1_BLOCKS

    bundle = tmp_path / "two"
    shutil.copytree(tiny_bundle, bundle)
    shutil.copy(bundle / "base-ort.onnx", bundle / "base-q4.onnx")  # points at base-ort.onnx.data
    manifest = read_manifest(bundle)
    q4 = graph_entry(bundle, "base", "base-q4.onnx", target="ort", precision=GGUF_Q4_1_BLOCKS)
    write_manifest(bundle, manifest.replace(graphs=(*manifest.graphs, q4)))
    cfg = GenerationConfig(max_new_tokens=16)
    lone = {"step_plan": "lone"}  # the fastest exact plan for one sequence, not the one whose rows batch
    with load(tiny_bundle, draft=None, **lone) as one, load(bundle, draft=None, **lone) as two, \
            load(bundle, draft="prompt-lookup", **lone) as spec:
        # The same arithmetic under two names: the probe finds the split plan exact, so it is taken.
        assert two.plan.split and two.plan.exact and spec.plan.split
        assert (two.backend.one_row_graph.file, two.backend.graph.file) == ("base-q4.onnx", "base-ort.onnx")
        rows = {"q4": [], "fp32": []}
        for key, attr in (("q4", "one_row_session"), ("fp32", "session")):
            sess = getattr(two.backend, attr)
            run = sess.run_with_iobinding

            def counted(binding, *a, _run=run, _key=key, **kw):
                rows[_key].append(1)
                return _run(binding, *a, **kw)

            sess.run_with_iobinding = counted
        for prompt in PROMPTS:
            ids = one.encode(prompt)
            ref = one.generate_ids(ids, cfg)
            assert two.generate_ids(ids, cfg) == ref
            assert spec.generate_ids(ids, cfg) == ref
        assert len(rows["fp32"]) == len(PROMPTS)  # the prefills
        assert len(rows["q4"]) == len(PROMPTS) * (cfg.max_new_tokens - 1)  # every 1-token step


def test_prompt_lookup_uses_the_measured_cost_curve(tiny_bundle):
    from specdeploy.runtime.cost_curve import measure_cost_curve
    from specdeploy.runtime.tree_cost import step_cost

    with load(tiny_bundle, draft="prompt-lookup") as spec, load(tiny_bundle, draft=None) as plain:
        curve = spec.cost_curve
        sizes = {t for t in (1, 2, 4, 8, 16, 32) if t <= spec.decoder.max_tree}  # exact plans: <= 16 rows
        assert curve is not None and curve[1] == 1.0 and set(curve) == sizes
        assert all(c > 0 for c in curve.values())
        assert spec.decoder.drafter._cost[7] == pytest.approx(step_cost(curve, 8))
        assert plain.cost_curve is None  # plain decoding measures nothing
        short = measure_cost_curve(plain.decoder, sizes=(1, 2), repeats=1, past=8)
        assert set(short) == {1, 2}
