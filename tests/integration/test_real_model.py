"""The same capabilities on the real SmolLM2-135M-Instruct (exported once per session)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from specdeploy.runtime import load
from specdeploy.runtime.decode import Decoder, DecodeStats, GenerationConfig

pytestmark = pytest.mark.slow
LOOKUP_TOKENS = 48  # per prompt, in the lookup and n-gram tests (8 MT-bench prompts)


def _mtbench_prompts(n: int) -> list[str]:
    from specdeploy.exporter.bench.run import default_prompts_file

    lines = default_prompts_file().read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines[:n]]


def test_validate_real_bundle(drafted):
    """validate on the real bundle (with the shipped drafts: test_real_drafts.py reads their checks)."""
    _, checks = drafted
    assert all(c.passed for c in checks)
    base = {"prefill", "tree", "prefill[ort]", "tree[ort]"}
    assert {c.case for c in checks} >= base  # both graphs checked
    worst = max(c.max_abs for c in checks if c.output == "logits" and c.case in base)
    assert worst < 1e-3


def test_ort_graph_keeps_the_gguf_blocks(real_bundle):
    """The default model is a Q4_1 GGUF: the CPU graph holds its 4-bit blocks, not fp32 copies."""
    import onnx
    from specdeploy.runtime.bundle import read_manifest

    manifest = read_manifest(real_bundle)
    ort_graph = manifest.cpu_base(multi_row=False)
    assert (ort_graph.file, ort_graph.precision) == ("base-q4.onnx", "gguf-q4_1")
    assert manifest.cpu_base(multi_row=True).file == "base-ort.onnx"  # prefill and tree steps: fused fp32
    model = onnx.load(str(real_bundle / ort_graph.file), load_external_data=False)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 4 * 30  # qkv, o_proj, gate_up, down_proj in each of the 30 layers
    assert all(a.i == 0 for n in nbits for a in n.attribute if a.name == "accuracy_level")  # fp32 compute
    from specdeploy.exporter.export.shared_data import weight_bytes

    data = weight_bytes(real_bundle, ort_graph.file)  # the weights it reads (some stored in another graph's file)
    assert data < 0.6 * weight_bytes(real_bundle, manifest.graph("base", "trt").file)


def test_32_greedy_tokens_match_transformers(real_bundle, plain_runs):
    import torch
    from specdeploy.exporter.source import load_model

    engine = plain_runs.engine(real_bundle)  # a plain engine on the bundle, as load(real_bundle, draft=None) opens
    assert engine.backend.graph.file == "base-ort.onnx"  # the prefill: the fused fp32 graph
    # 1-token steps run the GGUF-block graph only where the probe found that exact on this machine
    assert engine.plan.split == (engine.backend.one_row_session is not None)
    [(ids, ours)] = plain_runs.refs(real_bundle, ["What is the capital of France? Answer in one sentence."], 32)
    hf = load_model(None).model
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          eos_token_id=list(engine.manifest.model.eos_token_ids), pad_token_id=2)
    assert ours == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("tree", [None, "tree16"])
def test_prompt_lookup_identical_on_real_prompts(real_bundle, plain_runs, tree):
    taus = []
    with load(real_bundle, draft="prompt-lookup", tree=tree) as spec:
        plain_runs.same_plan(real_bundle, spec)
        for ids, ref in plain_runs.refs(real_bundle, _mtbench_prompts(8), LOOKUP_TOKENS):  # the n-gram test's too
            stats = DecodeStats()
            assert spec.generate_ids(ids, GenerationConfig(LOOKUP_TOKENS), stats) == ref
            taus.append(stats.mean_accepted)
    assert max(taus) > 1.0  # prompt lookup found real matches


def test_ngram_table_drafts_and_stays_identical_on_real_prompts(real_bundle, plain_runs, tmp_path):
    """The embedded model's n-gram table, from its committed replies, on the fp32 bundle (a hard-linked
    copy: the session's bundle stays as it is)."""
    import os
    import shutil
    from pathlib import Path

    from specdeploy.exporter.export.ngram import export_ngram

    bundle = tmp_path / "bundle"
    shutil.copytree(real_bundle, bundle, copy_function=os.link)
    replies = Path(__file__).resolve().parents[2] / "graphs" / "weights" / "self-replies.npz"
    export_ngram(bundle, replies, progress=lambda m: None)
    taus = []
    with load(bundle, draft="ngram") as spec:
        plain_runs.same_plan(real_bundle, spec)
        for ids, ref in plain_runs.refs(real_bundle, _mtbench_prompts(8), LOOKUP_TOKENS):
            stats = DecodeStats()
            assert spec.generate_ids(ids, GenerationConfig(LOOKUP_TOKENS), stats) == ref
            taus.append(stats.mean_accepted)
        sources = spec.decoder.drafter.sources
    assert sources["table"] > sources["lookup"] > 0  # both sources drafted, the table most (MT-bench: ~2x)
    assert np.mean(taus) > 1.3  # measured 1.70 on 80 MT-bench prompts x 128 tokens


@pytest.mark.parametrize("tree", ["tree16", "tree32"])
def test_static_trees_identical_with_branching_acceptance(real_bundle, plain_runs, tree):
    """Static trees filled with the true continuation on random branches (see test_decode.OracleDrafter)."""
    from specdeploy.runtime.drafters.base import Drafter
    from specdeploy.runtime.tree import DraftTree
    from specdeploy.runtime.tree_table import STATIC_TREES

    spec = STATIC_TREES[tree]
    rng = np.random.default_rng(1)
    engine = plain_runs.engine(real_bundle)  # the session's plain engine and replies (the drafts' tests' too)
    for ids, ref in plain_runs.refs(real_bundle, _mtbench_prompts(3), 48):

        class Oracle(Drafter):
            def propose(self, ctx, ids=ids, ref=ref):
                done = len(ctx.tokens) - len(ids)
                topk = rng.integers(0, 49152, (spec.depth, spec.topk))
                for d in range(spec.depth):  # truth at a random rank per depth
                    if done + d < len(ref):
                        topk[d, rng.integers(0, spec.topk)] = ref[done + d]
                tree = DraftTree.from_static(spec, ctx.tokens[-1], topk)
                n = min(ctx.max_nodes, tree.num_nodes)  # a prefix of a sorted static tree is a tree
                return DraftTree(tree.tokens[:n], tree.parents[:n])

        stats = DecodeStats()
        out = list(Decoder(engine.backend, engine.manifest, Oracle(), plan=engine.plan).generate(ids, GenerationConfig(48), stats))
        assert out == ref
        assert stats.mean_accepted > 1.0


def test_sampling_and_typical_acceptance_on_real_model(real_bundle):
    """Seeded speculative sampling is reproducible and uses only real tokens; typical mode is flagged lossy."""
    with load(real_bundle, draft="prompt-lookup") as engine:
        prompt = _mtbench_prompts(1)[0]
        a = engine.generate(prompt, chat=True, max_new_tokens=40, temperature=0.8, top_p=0.9, seed=7)
        b = engine.generate(prompt, chat=True, max_new_tokens=40, temperature=0.8, top_p=0.9, seed=7)
        assert a.token_ids == b.token_ids and a.text and not a.stats.lossy
        t = engine.generate(prompt, chat=True, max_new_tokens=40, temperature=0.8, typical=True, seed=7)
        assert t.stats.lossy and len(t.token_ids) > 0


def test_torch_backend_rebuilt_from_the_real_bundle_matches_onnx_runtime(real_bundle):
    """The torch backend (the GPU path's reference) reads the real bundle's fp32 weights, with no source model,
    and its prefill logits and device argmax agree with ONNX Runtime's fp32 graph on an MT-bench prompt."""
    from specdeploy.exporter.reference.torch_backend import TorchBackend
    from specdeploy.runtime.backends.ort import OrtBackend
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.capture import chain_feed
    from specdeploy.runtime.text import TextCodec

    manifest = read_manifest(real_bundle)
    ids = np.asarray(TextCodec(real_bundle, manifest.tokenizer).encode_chat(
        [{"role": "user", "content": _mtbench_prompts(1)[0]}]), np.int64)
    feed = chain_feed(ids, 0, 256, np.arange(len(ids)))
    with OrtBackend(real_bundle, manifest, threads=2) as ort_backend:
        ref = ort_backend.step(feed, ort_backend.new_cache(1, 256))
    with TorchBackend(real_bundle, manifest, device="cpu", cuda_graphs=False, threads=2) as backend:
        got = backend.step(feed, backend.new_cache(1, 256))
    logits = np.asarray(got.logits)
    np.testing.assert_allclose(logits, ref.logits, atol=2e-3, rtol=1e-3)
    assert got.argmax[0].tolist() == logits[0].argmax(-1).tolist()
    assert (got.argmax[0] == ref.logits[0].argmax(-1)).mean() > 0.99  # near-ties may flip a row or two
