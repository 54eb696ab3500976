"""Chimera draft: the graph, the unrolled training forward, training, export + ORT parity, the drafter.

Fast tests use tiny random configs (the shared training setup: ``tiny_training.py``, ``conftest.py``). The real
model, the hybrid and EAGLE-3 layer fusion: ``test_chimera_fusion.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from specdeploy.exporter.train.chimera import ChimeraTrainConfig
from specdeploy.exporter.train.modules import chimera_from_weights
from specdeploy.exporter.train.weights import load_draft_weights, train
from specdeploy.graphs.chimera import ChimeraDraft, ChimeraStepGraph, trigram_ids
from specdeploy.runtime import load
from specdeploy.runtime.decode import DecodeStats, GenerationConfig
from specdeploy.runtime.errors import DraftMismatchError, TrainingError, TreeSpecError
from tiny_training import CHIMERA_LOOP as TINY_LOOP
from tiny_training import TINY_CHIMERA as TINY
from tiny_training import chimera_task as _task
from tiny_training import graph_files as _graph_files


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _step(graph, hidden, tri, pos, length, t, cache_k, cache_v, base_hidden, head):
    """One draft step writing ``t`` rows at ``length..length+t`` of the cache (causal among them)."""
    cap = cache_k.shape[2]
    mask = torch.full((1, 1, t, cap), torch.finfo(torch.float32).min)
    mask[..., :length] = 0.0
    for j in range(t):
        mask[0, 0, j, length : length + j + 1] = 0.0
    feat, ids, logp, k, v = graph(hidden, tri, pos, mask, torch.arange(length, length + t), base_hidden,
                                  torch.tensor([head]), cache_k, cache_v)
    return feat, ids, logp, k, v


def test_fresh_trigram_encoder_returns_newest_embedding():
    draft = ChimeraDraft(TINY)
    emb3 = torch.randn(2, 5, 3, 16)
    assert torch.allclose(draft.trigram(emb3), emb3[:, :, 2])
    z = draft.head(torch.randn(2, 16), f := torch.randn(2, 16), 1)  # zero-initialised residual head
    assert torch.equal(z, f)


def test_trigram_ids_repeat_the_earliest_token():
    toks = [5, 6, 7, 8]
    assert trigram_ids(toks, [0, 1, 2]) == [[5, 5, 6], [5, 6, 7], [6, 7, 8]]


@pytest.mark.parametrize("depth", [1, 3])
def test_unrolled_training_forward_matches_step_by_step_drafting(depth):
    """The parallel training forward computes exactly what the exported step computes while drafting."""
    torch.manual_seed(0)
    draft = ChimeraDraft(TINY).eval()
    _randomize(draft)
    embed = torch.randn(50, 16)
    lm = torch.randn(50, 16)
    graph = ChimeraStepGraph(draft, embed, lm, topk=5).eval()
    length = 9
    tokens = torch.randint(0, 50, (length,))
    hidden = torch.randn(1, length, 16)
    with torch.no_grad():
        feats = draft.unrolled(embed[tokens][None], hidden, depth)
        for origin in (0, 3, length - depth - 1):
            cap = 16
            ck = torch.zeros(1, 2, cap, 4)
            cv = torch.zeros(1, 2, cap, 4)
            n = origin + 1  # real slots 0..origin
            tri = torch.tensor(trigram_ids(tokens.tolist(), range(n)))[None]
            feat, _, _, ck, cv = _step(graph, hidden[:, :n], tri, torch.arange(n)[None], 0, n, ck, cv,
                                       hidden[:, origin], 0)
            torch.testing.assert_close(feat[0], feats[0][0, origin], atol=1e-5, rtol=1e-4)
            for d in range(2, depth + 1):  # chain slot at position origin+d-1, trigram ending at x_{origin+d}
                slot = origin + d - 1
                tri = torch.tensor(trigram_ids(tokens.tolist(), [slot]))[None]
                feat, _, _, ck, cv = _step(graph, feat[:, None], tri, torch.tensor([[slot]]), slot, 1, ck, cv,
                                           hidden[:, origin], d - 1)
                torch.testing.assert_close(feat[0], feats[d - 1][0, origin], atol=1e-5, rtol=1e-4)


# --- training on a tiny model ---------------------------------------------------------------------------
WEIGHTS = Path(__file__).resolve().parents[2] / "graphs" / "weights"


def test_training_lowers_the_loss_and_logs_chain_accuracy(tiny_setup, chimera_weights):
    task = _task(tiny_setup)
    torch.manual_seed(0)
    fresh = task.build()
    idx = np.arange(task.num_examples())
    before = float(task.loss(fresh, idx)[0].detach())
    w = load_draft_weights(chimera_weights, "chimera")
    after = float(task.loss(chimera_from_weights(w), idx)[0].detach())
    assert after < before
    log = json.loads(chimera_weights.with_name("chimera.train.json").read_text())
    final = log["final"]
    assert len(final["top1"]) == 4 and len(final["chain"]) == 4 and final["chain_tau"] >= 1.0
    assert all(a >= b for a, b in zip(final["chain"], final["chain"][1:]))  # a chain only gets rarer
    assert w.config.kind == "chimera" and w.config.base_weight_sha == tiny_setup[0].weight_sha
    assert all(v.dtype == torch.float16 for k, v in w.tensors.items() if k.startswith("chimera."))
    assert not chimera_weights.with_name("chimera.safetensors.ckpt").exists()


def test_feature_regression_term_is_part_of_the_loss(tiny_setup):
    torch.manual_seed(0)
    with_f = _task(tiny_setup, feature_weight=1.0)
    without = _task(tiny_setup, feature_weight=0.0)
    model = with_f.build()
    idx = np.arange(4)
    assert float(with_f.loss(model, idx)[0].detach()) > float(without.loss(model, idx)[0].detach())


def test_interrupted_training_resumes_to_the_same_weights(tiny_setup, tmp_path):
    straight = tmp_path / "a.safetensors"
    train(_task(tiny_setup), straight, TINY_LOOP, show_progress=False, log=lambda m: None)
    resumed = tmp_path / "b.safetensors"
    train(_task(tiny_setup), resumed, TINY_LOOP, show_progress=False, log=lambda m: None, stop_after_steps=2)
    assert not resumed.exists()
    lines: list[str] = []
    train(_task(tiny_setup), resumed, TINY_LOOP, show_progress=False, log=lines.append)
    assert any("resuming from step 2" in m for m in lines)
    a, b = load_draft_weights(straight).tensors, load_draft_weights(resumed).tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_device_is_resolved_and_a_missing_gpu_is_one_sentence(monkeypatch):
    from click.testing import CliRunner
    from specdeploy.exporter.cli import main
    from specdeploy.exporter.train.options import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == "cpu" and resolve_device("CPU") == "cpu"
    with pytest.raises(TrainingError, match="torch sees no CUDA GPU"):
        resolve_device("cuda")
    for bad in ("tpu", "cpu:1", "cuda:x"):
        with pytest.raises(TrainingError, match="Unknown training device"):
            resolve_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(TrainingError, match="sees 1 GPU"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for kind in ("chimera", "medusa"):  # said before the model loads, without a traceback
        r = CliRunner().invoke(main, ["train", kind, "--out", "x.safetensors", "--device", "cuda"])
        assert r.exit_code != 0 and "no CUDA GPU" in r.output and "Traceback" not in r.output, r.output


def test_a_task_moves_its_frozen_tensors_to_its_device(tiny_setup):
    """One code path for every device: the frozen tensors and the batches follow ``task.to`` (the meta
    device stands in for a GPU here; it holds shapes, not data)."""
    task = _task(tiny_setup).to("meta")
    assert task.device_type == "meta"
    assert all(getattr(task, n).device.type == "meta" for n in task.device_tensors)
    assert all(t.device.type == "meta" for t in task._batch(task.train_seqs[:2]))


def test_bad_training_settings_get_one_sentence():
    with pytest.raises(TrainingError, match="head count"):
        ChimeraTrainConfig(num_heads=0)
    with pytest.raises(TrainingError, match="vocab-trim"):
        ChimeraTrainConfig(vocab_trim=10**6)


# --- export, parity, drafter -------------------------------------------------------------------------------
def test_export_records_the_draft_and_ort_matches_torch(chimera_bundle, tiny_setup):
    from specdeploy.exporter.check.validate import compare_drafts
    from specdeploy.runtime.bundle import read_manifest

    manifest = read_manifest(chimera_bundle)
    entry = manifest.draft("chimera")
    assert entry.base_weight_sha == manifest.source.weight_sha and entry.setting("num_heads") == 4
    assert [g.role for g in entry.graphs] == ["chimera", "chimera-int4"]
    assert chimera_bundle.stat().st_mode & 0o777 == 0o755  # the staged copy is not left private
    assert entry.graphs[1].precision == "int4" and entry.graphs[1].target == "ort"
    loaded, _ = tiny_setup
    checks = compare_drafts(chimera_bundle, manifest, loaded, list(range(100, 116)), progress=lambda m: None)
    names = {c.output for c in checks}
    assert names == {"feature", "topk_logprobs", "present_key", "present_value"}
    assert {c.case for c in checks} == {"chimera", "chimera-int4"}
    assert all(c.passed for c in checks), checks
    fp32 = [c for c in checks if c.case == "chimera"]
    assert all(c.atol == 1e-3 for c in fp32)


def test_the_draft_stores_no_base_weight_again(chimera_bundle, chimera_weights, tiny_model_factory, tmp_path):
    """The embedding table is the base graph's own bytes; an ort-only bundle gets only the int4 draft."""
    import onnx
    from specdeploy.exporter.export.base import export_base
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.exporter.export.shared_data import stored_twice
    from specdeploy.runtime.bundle import read_manifest

    assert stored_twice(chimera_bundle, _graph_files(chimera_bundle)) == []
    embed = next(t for t in onnx.load(str(chimera_bundle / "chimera-int4.onnx"), load_external_data=False)
                 .graph.initializer if t.name == "embed_weight")
    assert {e.key: e.value for e in embed.external_data}["location"] == "base-ort.onnx.data"
    ort_only = tmp_path / "ort"
    export_base(str(tiny_model_factory("llama")), ort_only, max_context=512, target="ort", progress=lambda m: None)
    before = sum(f.stat().st_size for f in ort_only.iterdir())
    export_draft(ort_only, "chimera", chimera_weights, progress=lambda m: None)
    manifest = read_manifest(ort_only)
    assert [g.role for g in manifest.draft("chimera").graphs] == ["chimera-int4"]  # what the CPU runtime uses
    assert "base-ort.onnx.data" in manifest.draft("chimera").graphs[0].data_files  # so the hash covers it
    assert not (ort_only / "chimera.onnx").exists() and not list(ort_only.glob(".chimera*"))
    assert stored_twice(ort_only, _graph_files(ort_only)) == []
    added = sum(f.stat().st_size for f in ort_only.iterdir()) - before
    embed_bytes = 4 * manifest.model.vocab_size * manifest.model.hidden_size
    assert added < embed_bytes  # the table was not written again
    with load(ort_only, draft=None) as plain, load(ort_only, draft="chimera") as spec:
        ids = plain.encode("The quick brown fox")
        assert spec.generate_ids(ids, GenerationConfig(24)) == plain.generate_ids(ids, GenerationConfig(24))
    export_draft(ort_only, "chimera", chimera_weights, progress=lambda m: None, precision="fp32")  # replace it
    read_manifest(ort_only)  # the base's data file, which the old draft also read, is still there


def test_an_int8_chimera_graph_on_request(chimera_bundle, chimera_weights, tiny_setup, tmp_path):
    """``--precision int8`` writes ``chimera-int8.onnx`` instead of the default int4 graph; the drafter runs
    it, torch agrees within the int8 bound, and speculation stays plain decoding."""
    from specdeploy.exporter.check.validate import compare_drafts
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.chimera import make_chimera_drafter

    bundle = tmp_path / "b"
    shutil.copytree(chimera_bundle, bundle)
    export_draft(bundle, "chimera", chimera_weights, progress=lambda m: None, precision="int8")
    manifest = read_manifest(bundle)
    assert [(g.role, g.precision) for g in manifest.draft("chimera").graphs] == [("chimera", "fp32"),
                                                                                  ("chimera-int8", "int8")]
    assert not (bundle / "chimera-int4.onnx").exists()
    assert Path(make_chimera_drafter(bundle, manifest).session._model_path).name == "chimera-int8.onnx"
    with pytest.raises(DraftMismatchError, match="no int4 graph"):
        make_chimera_drafter(bundle, manifest, precision="int4")
    with load(bundle, draft=None) as plain, load(bundle, draft="chimera") as spec:
        ids = plain.encode("The quick brown fox")
        assert spec.generate_ids(ids, GenerationConfig(24)) == plain.generate_ids(ids, GenerationConfig(24))
    loaded, _ = tiny_setup
    checks = [c for c in compare_drafts(bundle, manifest, loaded, list(range(100, 116)), progress=lambda m: None)
              if c.case == "chimera-int8"]
    assert {c.output for c in checks} == {"feature", "topk_logprobs", "present_key", "present_value"}
    assert all(c.passed and c.atol == 0.5 for c in checks), checks


def test_fp32_only_export_and_explicit_precision(chimera_bundle, chimera_weights, tmp_path):
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.chimera import make_chimera_drafter

    bundle = tmp_path / "b"
    shutil.copytree(chimera_bundle, bundle)
    export_draft(bundle, "chimera", chimera_weights, progress=lambda m: None, precision="fp32")
    manifest = read_manifest(bundle)
    assert [g.role for g in manifest.draft("chimera").graphs] == ["chimera"]
    assert not (bundle / "chimera-int4.onnx").exists()  # the replaced draft's files are gone
    make_chimera_drafter(bundle, manifest, precision="fp32")
    for precision in ("int8", "int4"):
        with pytest.raises(DraftMismatchError, match=f"no {precision} graph"):
            make_chimera_drafter(bundle, manifest, precision=precision)
    with pytest.raises(DraftMismatchError, match="Unknown draft precision"):
        export_draft(bundle, "chimera", chimera_weights, progress=lambda m: None, precision="int2")


@pytest.mark.parametrize("tree", [None, "chain4", "tree8", "dynamic:12"])
def test_chimera_drafter_matches_plain_greedy(chimera_bundle, tree):
    prompts = ["Hello there, how are you today?", "1 2 3 4 5 6 7 8", "The cat sat on the mat. The cat"]
    with pytest.raises(TreeSpecError, match="5 deep but the drafter proposes at most 4"):
        load(chimera_bundle, draft="chimera", tree="[[0],[0,0],[0,0,0],[0,0,0,0],[0,0,0,0,0]]")
    with load(chimera_bundle, draft=None) as plain, load(chimera_bundle, draft="chimera", tree=tree) as spec:
        for p in prompts:
            ids = plain.encode(p)
            ref = plain.generate_ids(ids, GenerationConfig(40))
            st = DecodeStats()
            assert spec.generate_ids(ids, GenerationConfig(40), st) == ref
            assert st.steps >= 1 and sum(st.accepted) == st.new_tokens - 1


def test_the_torch_drafter_drafts_as_the_onnx_one(chimera_bundle, chimera_weights):
    """The torch drafter (the same step module, on the base's device) proposes what the exported fp32 draft
    graph does in ONNX Runtime, over the base weights the torch backend reads from the bundle."""
    from specdeploy.exporter.reference.torch_backend import bundle_weights
    from specdeploy.exporter.reference.torch_drafters import load_chimera
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.chimera import make_chimera_drafter

    manifest = read_manifest(chimera_bundle)
    weights, _ = bundle_weights(chimera_bundle, manifest)
    onnx_drafter = make_chimera_drafter(chimera_bundle, manifest, tree="chain4", precision="fp32")
    torch_drafter = load_chimera(chimera_weights, weights["embed_tokens"], weights["lm_head_t"].t(), "cpu",
                                 torch.float32)
    from specdeploy.exporter.reference.torch_backend import TorchBackend
    from specdeploy.exporter.reference.torch_drafters import TorchChimeraDrafter
    from specdeploy.runtime.drafters import make_drafter

    backend = TorchBackend(chimera_bundle, manifest, device="cpu", cuda_graphs=False)
    hooked = make_drafter("chimera", chimera_bundle, manifest, tree="chain4", backend=backend).model  # the backend's
    assert isinstance(hooked, TorchChimeraDrafter) and hooked.graph.embed_weight.device.type == "cpu"
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2000, size=12)
    for grow in (0, 2, 1):  # a catch-up over the prompt, then steps that accepted 1 and 0 drafts (+ bonus)
        tokens = np.append(tokens, rng.integers(0, 2000, size=grow))
        hidden = rng.normal(size=(len(tokens) - 1 - torch_drafter.length, 64)).astype(np.float32)
        ids_o, logp_o = onnx_drafter.head_topk(tokens, hidden)
        ids_t, logp_t = torch_drafter.head_topk(tokens, hidden)
        assert hooked.head_topk(tokens, hidden)[0].tolist() == ids_o.tolist()
        assert ids_t.tolist() == ids_o.tolist() and torch_drafter.length == onnx_drafter.length
        np.testing.assert_allclose(logp_t, logp_o, atol=1e-4)
    assert torch_drafter.calls == 3 * 4


@pytest.mark.parametrize("regime", ["free", "steep"])
def test_adaptive_chains_follow_the_costs_and_stay_lossless(chimera_bundle, monkeypatch, regime):
    """A chain is sized per step by the chain policy: when rows and calls cost nothing every head drafts;
    when a row costs a whole step no step drafts. Either way the output is plain greedy's."""
    from specdeploy.runtime.drafters.depth import CallTimer

    monkeypatch.setattr(CallTimer, "call_cost", property(lambda self: 0.0))
    curve = {1: 1.0, 64: 1.0} if regime == "free" else {1: 1.0, 2: 2.0, 64: 64.0}
    prompts = ["Hello there, how are you today?", "1 2 3 4 5 6 7 8"]
    with load(chimera_bundle, draft=None) as plain, load(chimera_bundle, draft="chimera", tree="chain4") as spec:
        drafter = spec.decoder.drafter.model  # the draft behind the rule
        assert drafter.policy is not None and drafter.needs_cost_curve
        spec.decoder.drafter.use_cost_curve(curve)  # the rule's and the draft's own
        for p in prompts:
            ids = plain.encode(p)
            st = DecodeStats()
            assert spec.generate_ids(ids, GenerationConfig(32), st) == plain.generate_ids(ids, GenerationConfig(32))
            # free: every head drafts, as far as the tokens still wanted reach (32 in all, the first from the prefill)
            left = 31 - np.concatenate([[0], np.cumsum(st.accepted)[:-1]])
            want = [min(5, int(n)) for n in left] if regime == "free" else [1] * len(left)
            assert st.tree_sizes == want, (st.tree_sizes, want)
        seen = drafter.policy.calibration.seen  # verdicts, and each next root on the first token left out
        if regime == "free":  # on the steep curve the rule does not call the draft at all
            assert seen[0].sum() > 0 and seen[1:].sum() > 0


def test_wrong_kind_wrong_base_and_corrupt_weights(chimera_bundle, chimera_weights, tmp_path):
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest, write_manifest

    with pytest.raises(DraftMismatchError, match="not a medusa draft"):
        export_draft(chimera_bundle, "medusa", chimera_weights, progress=lambda m: None)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(chimera_weights.read_bytes()[:1000])
    with pytest.raises(DraftMismatchError, match="corrupt"):
        export_draft(chimera_bundle, "chimera", bad, progress=lambda m: None)
    bundle = tmp_path / "b"
    shutil.copytree(chimera_bundle, bundle)
    m = read_manifest(bundle)
    write_manifest(bundle, m.replace(source=m.source.__class__(m.source.path, m.source.format, "f" * 64)))
    with pytest.raises(DraftMismatchError, match="another base model"):
        export_draft(bundle, "chimera", chimera_weights, progress=lambda m: None)
    with pytest.raises(DraftMismatchError, match="another base model"):
        load(bundle, draft="chimera")


def test_calibration_times_trees_and_records_the_default(chimera_bundle, chimera_weights, tmp_path, monkeypatch):
    """Where the step plan allows trees (forced here: which plan this machine gets is the probe's)."""
    import dataclasses

    from specdeploy.exporter.calibrate.chimera import calibrate_chimera
    from specdeploy.runtime import engine as engine_module
    from specdeploy.runtime.bundle import read_manifest

    real = engine_module.resolve_plan
    monkeypatch.setattr(engine_module, "resolve_plan", lambda *a, **k: dataclasses.replace(
        real(*a, **k), speculate=True, exact=True, trees=True))

    bundle = tmp_path / "b"
    shutil.copytree(chimera_bundle, bundle)
    draft = tmp_path / "chimera.safetensors"
    shutil.copy(chimera_weights, draft)
    calib = calibrate_chimera(bundle, draft, prompts=1, max_new_tokens=8, trees=("chain4", "tree8"),
                              progress=lambda m: None)
    assert calib["default_tree"] in ("chain4", "tree8") and set(calib["sweep"]) == {"ar", "chain4", "tree8"}
    assert all(v["identical"] == "1/1" for v in calib["sweep"].values())
    assert json.loads(draft.with_name("chimera.calibration.json").read_text())["default_tree"] == calib["default_tree"]
    assert read_manifest(bundle).draft("chimera").setting("default_tree") == calib["default_tree"]
    with load(bundle, draft="chimera") as eng:
        assert eng.decoder.drafter.model.tree is not None


@pytest.mark.parametrize("first_trees", [True, False])
def test_chains_calibration_is_kept_apart(chimera_bundle, chimera_weights, tmp_path, monkeypatch, first_trees):
    """Where the step plan verifies chains only, the calibration times the adaptive chain and lands under
    ``row_exact``, a record; where it allows trees, at the top (``default_tree``, which the bundle's
    draft takes). Each keeps the other's result. Under chains the drafter sizes its chains itself, over
    every head. The plan is forced here: which one this machine gets is the probe's."""
    import dataclasses

    from specdeploy.exporter.calibrate.chimera import calibrate_chimera
    from specdeploy.runtime import engine as engine_module
    from specdeploy.runtime.bundle import read_manifest

    real = engine_module.resolve_plan
    trees = {"on": first_trees}
    monkeypatch.setattr(engine_module, "resolve_plan", lambda *a, **k: dataclasses.replace(
        real(*a, **k), speculate=True, exact=True, trees=trees["on"]))
    draft = tmp_path / "chimera.safetensors"
    shutil.copy(chimera_weights, draft)
    bundle = tmp_path / "bundle"
    shutil.copytree(chimera_bundle, bundle)
    results = {}
    for on in (first_trees, not first_trees):
        trees["on"] = on
        cands = ("tree8",) if on else None  # None: the default candidates
        results[on] = calibrate_chimera(bundle, draft, prompts=1, max_new_tokens=8, trees=cands,
                                        progress=lambda m: None)
        assert set(results[on]["sweep"]) == {"ar", *(cands or ("chain4",))}
        assert all(v["identical"] == "1/1" for v in results[on]["sweep"].values())
    saved = json.loads(draft.with_name("chimera.calibration.json").read_text())
    assert saved["default_tree"] == results[True]["default_tree"] == "tree8"
    assert saved["row_exact"]["default_tree"] == results[False]["default_tree"] == "chain4"
    entry = read_manifest(bundle).draft("chimera")
    assert entry.setting("default_tree") == "tree8"
    assert entry.setting("default_chain") is None
    trees["on"] = False
    with load(bundle, draft="chimera") as eng:
        drafter = eng.decoder.drafter.model
        assert drafter.tree.is_chain and drafter.tree.depth == drafter.num_heads and drafter.policy is not None
    trees["on"] = True
    with load(bundle, draft="chimera") as eng:
        assert eng.decoder.drafter.model.tree.num_nodes == 8 and eng.decoder.drafter.model.policy is None
