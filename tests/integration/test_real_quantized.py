"""The real SmolLM2 bundle at q4_1 (its own GGUF blocks: the main job's) and at int4: quality and losslessness."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from decode_checks import check_plan
from specdeploy.runtime import load
from specdeploy.runtime.bundle import read_manifest
from specdeploy.runtime.decode import GenerationConfig


@pytest.mark.slow
def test_real_q4_1_bundle_keeps_the_gguf_blocks_and_stays_lossless(real_quant_bundle, plain_runs):
    """SmolLM2 as its own Q4_1 blocks with int8 activations: near-fp32 quality, lossless speculation."""
    from specdeploy.exporter.check.validate import validate_bundle

    out = real_quant_bundle("q4_1")
    graph, trees = read_manifest(out).graphs
    assert (graph.file, graph.target, graph.precision) == ("base-ort.onnx", "ort", "q4_1")
    assert (trees.file, trees.target, trees.data_files) == ("base-tree.onnx", "ort-tree", ("base-ort.onnx.data",))
    model = onnx.load(str(out / graph.file), load_external_data=False)
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
             for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert sorted((a["bits"], a["accuracy_level"]) for a in attrs) == [(4, 4)] * 120 + [(8, 4)]  # + lm_head
    assert sum(n.op_type == "Gemm" for n in model.graph.node) == 120  # block minima stay fp32
    from collections import Counter

    # every linear keeps its Q4_1 blocks, the lm_head its Q8_0 ones; the embedding stays the fp32 table a draft shares
    assert Counter(how for _, how in graph.weight_blocks) == {"Q4_1": 210, "fp32": 1}
    lines: list[str] = []
    validate_bundle(out, progress=lines.append)  # raises ValidationFailed on any failure
    text = "\n".join(lines)
    top1 = float(next(line for line in lines if "top-1 agreement" in line).split()[3])
    assert top1 >= 0.88, text  # measured 0.919 (int4: 0.617): no second rounding of the weights
    # validate states the padded and exact-tree plans' verdicts (test_real_trees.py runs the tree plan)
    assert {"padded-16", "gathered", "gathered-padded-16"} <= {line.split()[1] for line in lines
                                                             if line.lstrip().startswith("plan ")}, text
    from specdeploy.exporter.bench.run import default_prompts_file

    prompts = [json.loads(line)["turns"][0] for line in default_prompts_file().read_text().splitlines()[4:7]]
    refs = plain_runs.refs(out, prompts, 48)  # plain decoding's replies, once: the drafts added below leave the base
    with load(out, draft="prompt-lookup", tree="tree16") as spec:
        check_plan(plain_runs.engine(out), spec, text)
        for ids, ref in refs:
            assert spec.generate_ids(ids, GenerationConfig(48)) == ref
    # The main job's bundle: plus the shipped Chimera draft, lean, and the hybrid lossless on it.
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.exporter.export.shared_data import stored_twice

    weights = Path(__file__).resolve().parents[2] / "graphs" / "weights" / "chimera.safetensors"
    export_draft(out, "chimera", weights, progress=lambda m: None)
    bundle = read_manifest(out)
    files = [g.file for g in bundle.graphs] + [g.file for d in bundle.drafts for g in d.graphs]
    assert files == ["base-ort.onnx", "base-tree.onnx", "chimera-int4.onnx"]  # what the CPU runs
    assert stored_twice(out, files) == []  # the draft reads the base's embedding table
    assert sum(f.stat().st_size for f in out.iterdir()) < 0.4e9  # 250 MB measured; 1.0 GB allowed
    with load(out, draft="hybrid") as hybrid:
        plain_runs.same_plan(out, hybrid)
        for ids, ref in refs:
            assert hybrid.generate_ids(ids, GenerationConfig(48)) == ref
    # ... and the model's n-gram table (what the main job adds): ngram and the hybrid over it, lossless.
    from specdeploy.exporter.export.ngram import export_ngram

    export_ngram(out, weights.parent / "self-replies.npz", progress=lambda m: None)
    with load(out, draft="ngram") as ngram, load(out, draft="hybrid") as hybrid:
        assert hybrid.decoder.drafter.lookup.kind == "ngram"
        plain_runs.same_plan(out, ngram)
        for ids, ref in refs:
            assert ngram.generate_ids(ids, GenerationConfig(48)) == ref
            assert hybrid.generate_ids(ids, GenerationConfig(48)) == ref
        assert ngram.decoder.drafter.sources["table"] > 0
    # ... and batched: three chat requests at once, each drafting from the table, give plain decoding's replies
    # (one at a time, exactly, where no step plan batches rows here; test_real_batching.py checks more loads).
    from decode_checks import concurrently

    msgs = [[{"role": "user", "content": p}] for p in prompts]
    with load(out, draft="ngram", max_batch=3) as eng:
        assert eng.max_batch == (3 if eng.plan.rows else 1), eng.batch_reason
        batched = concurrently(eng, [None] * len(msgs), messages_list=msgs, max_new_tokens=48)
    assert [list(b.token_ids) for b in batched] == [ref for _, ref in refs]


@pytest.mark.slow
def test_real_int4_bundle_validates_and_stays_lossless(real_quant_bundle, plain_runs):
    """SmolLM2 at int4 (int8 activations): validate passes, prompt-lookup == plain greedy on the probed plan."""
    from specdeploy.exporter.check.validate import validate_bundle

    out = real_quant_bundle("int4")
    lines: list[str] = []
    validate_bundle(out, progress=lines.append)  # raises ValidationFailed on any failure
    text = "\n".join(lines)
    assert "quality (int4 vs torch fp32" in text, text
    from specdeploy.exporter.bench.run import default_prompts_file

    prompts = [json.loads(line)["turns"][0] for line in default_prompts_file().read_text().splitlines()[:4]]
    from specdeploy.exporter.export.ngram import export_ngram

    replies = Path(__file__).resolve().parents[2] / "graphs" / "weights" / "self-replies.npz"
    export_ngram(out, replies, progress=lambda m: None)
    with load(out, draft="prompt-lookup", tree="tree16") as spec, load(out, draft="ngram") as ngram:
        check_plan(plain_runs.engine(out), spec, text)
        refs = plain_runs.refs(out, prompts, 48)
        ids_all = [ids for ids, _ in refs]
        for ids, ref in refs:
            assert spec.generate_ids(ids, GenerationConfig(48)) == ref
            assert ngram.generate_ids(ids, GenerationConfig(48)) == ref
        refused = [r for r in spec.plan.probes if not r.chains_exact]
    if refused:
        # The control: speculation forced onto the fastest plan the probe refused differs from plain
        # decoding on that plan, so the identity above is the probe's doing, not luck.
        from specdeploy.runtime.decode import Decoder
        from specdeploy.runtime.drafters import PromptLookupDrafter
        from specdeploy.runtime.plan import StepPlan

        forced = StepPlan(refused[0].candidate, True, False, True, 64, "forced inexact")
        with load(out, draft=None) as eng:
            bare = Decoder(eng.backend, eng.manifest, None, plan=forced)
            lossy = Decoder(eng.backend, eng.manifest, PromptLookupDrafter(), plan=forced)
            differ = sum(list(bare.generate(ids, GenerationConfig(48))) != list(lossy.generate(ids, GenerationConfig(48)))
                         for ids in ids_all)
        assert differ >= 1
