"""Medusa and Cerberus heads: graphs, training, export + ORT parity, drafters, the gate, bad input.

Fast tests use the tiny random llama; the last tests use the real SmolLM2 bundle and the shipped weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from specdeploy.exporter.train.weights import load_draft_weights, train
from specdeploy.graphs.build import build_heads
from specdeploy.graphs.heads import DraftHeadsGraph, HeadsConfig, ResBlock
from specdeploy.runtime import load
from specdeploy.runtime.decode import DecodeStats, GenerationConfig
from specdeploy.runtime.errors import DraftMismatchError, TrainingError
from tiny_training import HEADS_LOOP as TINY_LOOP
from tiny_training import TINY_DATA
from tiny_training import heads_task as _task

WEIGHTS = Path(__file__).resolve().parents[2] / "graphs" / "weights"


# --- graphs ---------------------------------------------------------------------------------------
def _cfg(kind: str, heads: int = 4) -> HeadsConfig:
    return HeadsConfig(kind, heads, hidden_size=16, vocab_size=50, base_weight_sha="x")


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_zero_init_resblock_is_identity():
    x = torch.randn(3, 5, 16)
    assert torch.equal(ResBlock(16)(x), x)
    assert torch.equal(ResBlock(32, 16)(torch.cat([x, x], -1), residual=x), x)
    for kind in ("medusa", "cerberus"):
        z = build_heads(_cfg(kind))(x)  # fresh heads return h for every head
        assert z.shape == (3, 5, 4, 16)
        assert torch.equal(z, x.unsqueeze(-2).expand_as(z))


@pytest.mark.parametrize("kind", ["medusa", "cerberus"])
def test_heads_graph_shapes_and_trimmed_ids(kind):
    heads = build_heads(_cfg(kind, heads=3))
    _randomize(heads)
    lm = torch.randn(50, 16)
    ids, logp = DraftHeadsGraph(heads, lm, topk=5)(torch.randn(2, 4, 16))
    assert ids.shape == logp.shape == (2, 4, 3, 5) and ids.dtype == torch.int64
    assert torch.all(logp[..., :-1] >= logp[..., 1:])  # best first
    vocab_map = torch.tensor([7, 3, 41, 12, 0, 9, 22, 30])
    ids_t, logp_t = DraftHeadsGraph(heads, lm, topk=5, vocab_map=vocab_map)(torch.randn(2, 4, 16))
    assert set(ids_t.unique().tolist()) <= set(vocab_map.tolist())
    assert torch.allclose(logp_t.exp().sum(-1), logp_t.exp().sum(-1))  # finite
    with pytest.raises(ValueError):
        DraftHeadsGraph(heads, lm, topk=9, vocab_map=vocab_map)


def test_cerberus_heads_depend_on_earlier_heads_only():
    heads = build_heads(_cfg("cerberus"))
    _randomize(heads)
    x = torch.randn(2, 3, 16)
    base = heads(x).detach()
    k = 2
    with torch.no_grad():  # change head k-1's blocks: heads >= k-1 change, heads < k-1 do not
        heads.seq_blocks[k - 1].linear.weight.add_(0.5)
    after = heads(x).detach()
    assert torch.equal(after[..., : k - 1, :], base[..., : k - 1, :])
    assert not torch.allclose(after[..., k, :], base[..., k, :])
    with torch.no_grad():  # change head k's first block: earlier heads stay
        heads.blocks[k].linear.bias.add_(0.5)
    again = heads(x).detach()
    assert torch.equal(again[..., :k, :], after[..., :k, :])
    assert not torch.allclose(again[..., k, :], after[..., k, :])
    medusa = build_heads(_cfg("medusa"))
    _randomize(medusa)
    m0 = medusa(x).detach()
    with torch.no_grad():
        medusa.heads[1].blocks[0].linear.bias.add_(0.5)
    m1 = medusa(x).detach()
    assert torch.equal(m1[..., 2, :], m0[..., 2, :])  # Medusa heads are independent


# --- training ---------------------------------------------------------------------------------------
def test_training_lowers_the_loss_and_logs_heldout_accuracy(tiny_setup, tiny_draft):
    task = _task(tiny_setup, "cerberus", vocab_trim=4096)
    torch.manual_seed(0)
    model = task.build()
    idx = np.arange(min(256, task.num_examples()))
    before = float(task.loss(model, idx)[0].detach())
    w = load_draft_weights(tiny_draft("cerberus"), "cerberus")
    from specdeploy.exporter.train.modules import heads_from_weights

    after = float(task.loss(heads_from_weights(w), idx)[0].detach())
    assert after < before
    log = json.loads(tiny_draft("cerberus").with_name("cerberus.train.json").read_text())
    assert len(log["history"]) == TINY_LOOP.epochs and len(log["final"]["top1"]) == 4
    assert w.config.base_weight_sha == tiny_setup[0].weight_sha and w.config.num_heads == 4
    assert w.meta["data"]["sequences"] == TINY_DATA.max_seqs
    assert not tiny_draft("cerberus").with_name("cerberus.safetensors.ckpt").exists()


def test_resume_continues_with_identical_state(tiny_setup, tmp_path):
    straight = tmp_path / "a.safetensors"
    train(_task(tiny_setup, "medusa", vocab_trim=1024), straight, TINY_LOOP, show_progress=False, log=lambda m: None)
    resumed = tmp_path / "b.safetensors"
    train(_task(tiny_setup, "medusa", vocab_trim=1024), resumed, TINY_LOOP, show_progress=False, log=lambda m: None,
          stop_after_steps=3)
    assert not resumed.exists() and (tmp_path / "b.safetensors.ckpt" / "latest.json").is_file()
    lines = []
    train(_task(tiny_setup, "medusa", vocab_trim=1024), resumed, TINY_LOOP, show_progress=False, log=lines.append)
    assert any("resuming from step 3" in m for m in lines)
    a, b = load_draft_weights(straight).tensors, load_draft_weights(resumed).tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_time_limit_ends_the_run_with_weights(tiny_setup, tmp_path):
    """A time limit stops after the first step past it, evaluates and writes the weights reached."""
    from dataclasses import replace

    out, lines = tmp_path / "t.safetensors", []
    result = train(_task(tiny_setup, "medusa", vocab_trim=1024), out, replace(TINY_LOOP, time_limit_s=0.0),
                   show_progress=False, log=lines.append)
    assert result.steps == 1 and result.final is not None and out.is_file()
    assert any("time limit reached at step 1/" in m for m in lines)
    meta = load_draft_weights(out).meta
    assert meta["train"]["steps"] == 1 < meta["train"]["planned_steps"]
    assert not (tmp_path / "t.safetensors.ckpt").exists()
    with pytest.raises(TrainingError, match="time limit"):
        replace(TINY_LOOP, time_limit_s=-1.0)


def test_corrupt_checkpoint_and_mismatched_settings(tiny_setup, tmp_path):
    out = tmp_path / "c.safetensors"
    task = _task(tiny_setup, "medusa", vocab_trim=1024)
    train(task, out, TINY_LOOP, show_progress=False, log=lambda m: None, stop_after_steps=1)
    with pytest.raises(TrainingError, match="other settings"):
        train(_task(tiny_setup, "medusa", num_heads=3, vocab_trim=1024), out, TINY_LOOP, show_progress=False,
              log=lambda m: None)
    ckpt = next((tmp_path / "c.safetensors.ckpt").glob("step-*"))
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(TrainingError, match="corrupt"):
        train(task, out, TINY_LOOP, show_progress=False, log=lambda m: None)
    with pytest.raises(TrainingError, match="no checkpoint"):
        train(_task(tiny_setup, "medusa"), tmp_path / "d.safetensors", TINY_LOOP, resume="require",
              show_progress=False, log=lambda m: None)


def test_weights_file_errors(tiny_draft, tmp_path):
    with pytest.raises(DraftMismatchError, match="not a cerberus draft"):
        load_draft_weights(tiny_draft("medusa"), "cerberus")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors at all")
    with pytest.raises(DraftMismatchError, match="corrupt"):
        load_draft_weights(bad)
    with pytest.raises(DraftMismatchError, match="does not exist"):
        load_draft_weights(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(DraftMismatchError, match="not a specdeploy draft"):
        load_draft_weights(tmp_path / "foreign.safetensors")


# --- export, parity, drafters -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def heads_bundle(tiny_bundle_factory, tiny_draft, tmp_path_factory):
    """A copy of the tiny bundle with both drafts; Cerberus gets a hand-made calibration."""
    from specdeploy.exporter.export.draft import calibration_path, export_draft
    from specdeploy.runtime.bundle import hash_files

    bundle = tmp_path_factory.mktemp("heads_bundle") / "b"
    shutil.copytree(tiny_bundle_factory("llama"), bundle)
    export_draft(bundle, "medusa", tiny_draft("medusa"), progress=lambda m: None)
    cal = calibration_path(tiny_draft("cerberus"))
    cal.write_text(json.dumps({"kind": "cerberus", "weights_sha": hash_files([tiny_draft("cerberus")]),
                               "default_tree": "tree16", "gate": {"kind": "entropy", "threshold": 6.0}}))
    export_draft(bundle, "cerberus", tiny_draft("cerberus"), progress=lambda m: None)
    return bundle


def test_the_heads_and_gate_graphs_follow_the_draft_contract(heads_bundle):
    """Every exported heads graph (any precision) and Cerberus' gate graph has the contract's inputs and outputs."""
    from contract_checks import follows
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.draft_contract import GATE, HEADS
    from specdeploy.runtime.drafters.kinds import describe

    roles = []
    for entry in read_manifest(heads_bundle).drafts:
        gate = describe(entry.kind).gate_role
        for graph in entry.graphs:
            follows(graph, GATE if gate and graph.role == gate.role else HEADS)
            roles.append(graph.role)
    assert "cerberus-gate" in roles and any(r.startswith("medusa") for r in roles)


def test_export_records_draft_entries_and_ort_parity(heads_bundle, tiny_setup):
    from specdeploy.exporter.check.validate import compare_drafts
    from specdeploy.runtime.bundle import read_manifest

    manifest = read_manifest(heads_bundle)
    kinds = {d.kind: d for d in manifest.drafts}
    assert set(kinds) == {"medusa", "cerberus"}
    # The tiny bundle has a TensorRT base graph, so the fp32 heads graph is kept beside the int4 one.
    assert [g.role for g in kinds["cerberus"].graphs] == ["cerberus", "cerberus-int4", "cerberus-gate"]
    assert [(g.precision, g.target) for g in kinds["medusa"].graphs] == [("fp32", "trt"), ("int4", "ort")]
    assert kinds["cerberus"].setting("gate_kind") == "entropy" and kinds["cerberus"].setting("default_tree") == "tree16"
    assert all(d.base_weight_sha == manifest.source.weight_sha for d in manifest.drafts)
    spec = {s.name: s for s in kinds["medusa"].graphs[0].outputs}
    assert spec["topk_ids"].dtype == "int64" and len(spec["topk_ids"].shape) == 4
    loaded, _ = tiny_setup
    checks = compare_drafts(heads_bundle, manifest, loaded, list(range(100, 116)), progress=lambda m: None)
    assert len(checks) == 6 and all(c.passed for c in checks), checks
    assert {c.case for c in checks} == {"medusa", "medusa-int4", "cerberus", "cerberus-int4", "cerberus-gate"}
    assert {c.case: c.atol for c in checks if c.output == "topk_logprobs"}["medusa"] == 1e-3


def test_the_cpu_drafter_runs_the_int4_heads_and_fp32_only_exports_have_none(heads_bundle, tiny_draft, tmp_path):
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.heads import cpu_graph_role

    manifest = read_manifest(heads_bundle)
    with load(heads_bundle, draft="medusa") as eng:
        used = eng.decoder.drafter.model.session._model_path
    assert Path(used).name == "medusa-int4.onnx" and cpu_graph_role(manifest.draft("medusa"), "fp32") == "medusa"
    bundle = tmp_path / "b"
    shutil.copytree(heads_bundle, bundle)
    export_draft(bundle, "medusa", tiny_draft("medusa"), progress=lambda m: None, precision="fp32")
    entry = read_manifest(bundle).draft("medusa")
    assert [g.role for g in entry.graphs] == ["medusa"] and not (bundle / "medusa-int4.onnx").exists()
    assert cpu_graph_role(entry) == "medusa"
    with pytest.raises(DraftMismatchError, match="no int8 graph"):
        cpu_graph_role(entry, "int8")
    with pytest.raises(DraftMismatchError, match="Unknown draft precision"):
        export_draft(bundle, "medusa", tiny_draft("medusa"), progress=lambda m: None, precision="int2")


def test_an_int8_heads_graph_on_request(heads_bundle, tiny_draft, tiny_setup, tmp_path):
    """``--precision int8`` writes ``<kind>-int8.onnx`` instead of the default int4 graph; "auto" runs it,
    and the output stays plain decoding's."""
    from specdeploy.exporter.check.validate import compare_drafts
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.heads import cpu_graph_role

    bundle = tmp_path / "b"
    shutil.copytree(heads_bundle, bundle)
    export_draft(bundle, "medusa", tiny_draft("medusa"), progress=lambda m: None, precision="int8")
    manifest = read_manifest(bundle)
    entry = manifest.draft("medusa")
    assert [(g.role, g.precision) for g in entry.graphs] == [("medusa", "fp32"), ("medusa-int8", "int8")]
    assert not (bundle / "medusa-int4.onnx").exists()  # the replaced int4 graph is gone
    assert cpu_graph_role(entry) == "medusa-int8" == cpu_graph_role(entry, "int8")
    with pytest.raises(DraftMismatchError, match="no int4 graph; re-export it with --precision int4"):
        cpu_graph_role(entry, "int4")
    with load(bundle, draft=None) as plain, load(bundle, draft="medusa", tree="chain4") as spec:
        assert Path(spec.decoder.drafter.model.session._model_path).name == "medusa-int8.onnx"
        ids = plain.encode("The quick brown fox")
        assert spec.generate_ids(ids, GenerationConfig(24)) == plain.generate_ids(ids, GenerationConfig(24))
    loaded, _ = tiny_setup
    checks = [c for c in compare_drafts(bundle, manifest, loaded, list(range(100, 116)), progress=lambda m: None)
              if c.case == "medusa-int8"]
    assert len(checks) == 1 and checks[0].atol == 0.5 and checks[0].passed, checks


def test_an_ort_only_bundle_gets_only_the_int4_heads(tiny_model_factory, tiny_draft, tmp_path):
    from specdeploy.exporter.export.base import export_base
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest

    bundle = tmp_path / "ort"
    export_base(str(tiny_model_factory("llama")), bundle, max_context=512, target="ort", progress=lambda m: None)
    export_draft(bundle, "medusa", tiny_draft("medusa"), progress=lambda m: None)
    assert [g.role for g in read_manifest(bundle).draft("medusa").graphs] == ["medusa-int4"]
    assert not (bundle / "medusa.onnx").exists() and not list(bundle.glob(".medusa*"))
    with load(bundle, draft=None) as plain, load(bundle, draft="medusa", tree="chain4") as spec:
        ids = plain.encode("The quick brown fox")
        assert spec.generate_ids(ids, GenerationConfig(24)) == plain.generate_ids(ids, GenerationConfig(24))


@pytest.mark.parametrize("draft,tree", [("medusa", None), ("medusa", "chain4"), ("cerberus-nogate", "dynamic:12"),
                                        ("cerberus", None), ("cerberus", "chain4"), ("hybrid:medusa", None),
                                        ("hybrid:cerberus", None)])
def test_drafters_match_plain_greedy(heads_bundle, draft, tree):
    from specdeploy.runtime.drafters.heads import GateSpec

    prompts = ["Hello there, how are you today?", "1 2 3 4 5 6 7 8", "The cat sat on the mat. The cat"]
    with load(heads_bundle, draft=None) as plain, load(heads_bundle, draft=draft, tree=tree) as spec:
        # Identity whatever is drafted: the rule is set aside, so the draft (and Cerberus's gate) run every step.
        spec.decoder.drafter.always_model = True
        drafter = spec.decoder.drafter.model  # behind the rule (or the hybrid's): the draft itself
        if draft == "cerberus":  # a signal that alternates between a band that pays and one that never does
            drafter.gate = GateSpec("learned")
            drafter.use_cost_curve({1: 1.0, 64: 2.0})
            seen = drafter.gate_policy.calibration.seen
            seen[0, 9], seen[0, 0] = [100, 0], [0, 100]
            calls = iter(range(10**6))
            drafter.gate_session.run = lambda names, feed: (np.zeros((1, 1)), np.full((1, 1), 0.95 if next(calls) % 2
                                                                                       else 0.05))
        gate = [0, 0]
        for p in prompts:
            ids = plain.encode(p)
            ref = plain.generate_ids(ids, GenerationConfig(40))
            st = DecodeStats()
            assert spec.generate_ids(ids, GenerationConfig(40), st) == ref
            gate[0] += st.gate_parallel
            gate[1] += st.gate_ar
            assert st.gate_parallel + st.gate_ar == st.steps
    # steps where nothing was drafted (the gate declined, or an adaptive chain found no token worth its row)
    # ran plainly, counted in gate[1]
    if draft == "cerberus":  # the gate, asked only on steps the rule allows, sent some to plain decoding
        assert gate[1] > 0
        decisions = drafter.gate_policy.decisions
        assert decisions["plain"] > 0 and decisions["draft"] + decisions["explore"] > 0
        assert decisions["plain"] <= gate[1] and sum(decisions.values()) <= gate[0] + gate[1]


def test_the_torch_backend_runs_heads_drafts_on_its_device_as_onnx_does(heads_bundle):
    """Through the backend hook, the torch backend's heads drafts (the modules export traces, in torch) give
    the ONNX Runtime drafts' top-k and Cerberus' gate signals; the hybrid takes the torch model draft too."""
    from specdeploy.exporter.reference.torch_backend import TorchBackend
    from specdeploy.exporter.reference.torch_drafters import TorchSession
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters import make_drafter
    from specdeploy.runtime.drafters.heads import make_heads_drafter

    manifest = read_manifest(heads_bundle)
    rng = np.random.default_rng(0)
    with TorchBackend(heads_bundle, manifest, device="cpu", cuda_graphs=False) as backend:
        for name in ("medusa", "cerberus"):
            ours = make_drafter(name, heads_bundle, manifest, backend=backend).model  # the draft behind the rule
            onnx = make_heads_drafter(name, heads_bundle, manifest, precision="fp32")  # the graph torch traces
            assert isinstance(ours.session, TorchSession) and not isinstance(onnx.session, TorchSession)
            for _ in range(3):
                hidden = rng.normal(size=64).astype(np.float32)
                ids_t, logp_t = ours.head_topk(hidden)
                ids_o, logp_o = onnx.head_topk(hidden)
                assert ids_t.tolist() == ids_o.tolist()
                np.testing.assert_allclose(logp_t, logp_o, atol=1e-4)
            if name == "cerberus":
                feed = {"hidden_states": rng.normal(size=(1, 1, 64)).astype(np.float32),
                        "logits": rng.normal(size=(1, 1, 49152)).astype(np.float32)}
                for got, want in zip(ours.gate_session.run(None, feed), onnx.gate_session.run(None, feed),
                                     strict=True):
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        hybrid = make_drafter("hybrid:medusa", heads_bundle, manifest, backend=backend)
        assert isinstance(hybrid.model.session, TorchSession)


def test_unknown_gate_and_missing_calibration(heads_bundle, tiny_draft, tmp_path):
    from specdeploy.runtime.bundle import config_pairs, read_manifest, write_manifest
    from specdeploy.runtime.drafters.heads import GateConfigError, GateSpec

    with pytest.raises(GateConfigError, match="Unknown gate"):
        GateSpec("coin")
    bundle = tmp_path / "b"
    shutil.copytree(heads_bundle, bundle)
    manifest = read_manifest(bundle)
    entry = manifest.draft("cerberus")
    # no calibration: cerberus refuses in one sentence, cerberus-nogate works
    settings = {k: v for k, v in entry.config if k != "gate_kind"}
    bare = entry.__class__(entry.kind, entry.base_weight_sha, entry.weights_sha, entry.graphs, config_pairs(settings))
    write_manifest(bundle, manifest.replace(drafts=tuple(d if d.kind != "cerberus" else bare for d in manifest.drafts)))
    with pytest.raises(GateConfigError, match="no gate calibration"):
        load(bundle, draft="cerberus")
    load(bundle, draft="cerberus-nogate").close()


def test_wrong_kind_and_wrong_base_get_one_sentence(heads_bundle, tiny_draft, tmp_path):
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest, write_manifest

    with pytest.raises(DraftMismatchError, match="not a cerberus draft"):
        export_draft(heads_bundle, "cerberus", tiny_draft("medusa"), progress=lambda m: None)
    # a bundle of another base model (its weight hash differs): refused at export and at load
    bundle = tmp_path / "b"
    shutil.copytree(heads_bundle, bundle)
    m = read_manifest(bundle)
    write_manifest(bundle, m.replace(source=m.source.__class__(m.source.path, m.source.format, "f" * 64)))
    with pytest.raises(DraftMismatchError, match="another base model"):
        export_draft(bundle, "medusa", tiny_draft("medusa"), progress=lambda m: None)
    with pytest.raises(DraftMismatchError, match="another base model"):
        load(bundle, draft="medusa")
    write_manifest(bundle, m.replace(drafts=tuple(d for d in m.drafts if d.kind == "medusa")))
    with pytest.raises(DraftMismatchError, match="no 'cerberus' draft"):
        load(bundle, draft="cerberus")
    with pytest.raises(DraftMismatchError, match="Unknown draft"):
        load(bundle, draft="hydra")


def test_calibration_picks_tree_and_gate_on_the_tiny_bundle(heads_bundle, tiny_draft, tmp_path):
    from specdeploy.exporter.calibrate.heads import calibrate

    bundle = tmp_path / "b"
    shutil.copytree(heads_bundle, bundle)
    draft = tmp_path / "cerberus.safetensors"
    shutil.copy(tiny_draft("cerberus"), draft)
    calib = calibrate(bundle, "cerberus", draft, prompts=2, max_new_tokens=12, confirm_prompts=1,
                      trees=("chain4", "tree8"), trims=(4096,), progress=lambda m: None, show_progress=False)
    assert calib["default_tree"] in ("chain4", "tree8") and calib["gate"]["kind"] in ("entropy", "learned")
    best = calib["gate"]["sim_tok_s"]
    # The gate's sweep includes never drafting, which pays the gate's own cost on every plain step.
    costs = calib["costs_ms"]
    never = calib["gate"]["always_ar_sim_tok_s"] * costs["ar_step"] / (costs["ar_step"] + costs["gate"])
    assert best >= max(calib["gate"]["gate_off_sim_tok_s"], never) * (1 - 1e-3)
    assert load_draft_weights(draft).prefixed("gate.")  # the learned gate was stored
    assert calib["confirm"]["cerberus"]["identical"] == "1/1"
    with load(bundle, draft="cerberus") as eng:
        eng.generate_ids(eng.encode("Hi"), GenerationConfig(4))


def test_a_heads_task_moves_its_frozen_tensors_to_its_device(tiny_setup):
    """The meta device stands in for a GPU: the frozen tensors and the batches follow ``task.to``."""
    task = _task(tiny_setup, "cerberus", vocab_trim=64).to("meta")
    assert all(getattr(task, n).device.type == "meta" for n in task.device_tensors)
    assert all(t.device.type == "meta" for t in task._batch(task.train_pos[:4]))


def test_compact_draft_weights_round_trip(tiny_draft, tmp_path):
    """int8 rows with fp16 scales load back as float32 within half a step of each row's scale; the ids stay
    whole; the calibration follows the new file; the shipped drafts are stored so."""
    from safetensors import safe_open
    from specdeploy.exporter.export.draft import calibration_path
    from specdeploy.exporter.train.compact import compact_draft_weights
    from specdeploy.exporter.train.weights import SCALE_SUFFIX
    from specdeploy.runtime.bundle import hash_files

    src = tiny_draft("cerberus")
    calibration_path(src).write_text(json.dumps({"kind": "cerberus", "weights_sha": hash_files([src])}))
    dst = tmp_path / "cerberus.safetensors"
    compact_draft_weights(src, dst)
    a, b = load_draft_weights(src).tensors, load_draft_weights(dst, "cerberus").tensors
    assert set(a) == set(b)
    with safe_open(str(dst), framework="pt") as fh:
        stored = {k: fh.get_slice(k).get_dtype() for k in fh.keys()}  # noqa: SIM118 - not iterable
    packed = [k for k in a if k + SCALE_SUFFIX in stored]
    assert packed and all(stored[k] == "I8" for k in packed)
    for k in a:
        if k in packed:
            step = a[k].float().abs().amax(-1, keepdim=True) / 127
            assert b[k].dtype == torch.float32 and ((a[k].float() - b[k]).abs() <= 0.51 * step + 1e-6).all()
        elif a[k].is_floating_point():
            assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-3, atol=1e-4)
        else:
            assert b[k].dtype == torch.int64 and torch.equal(a[k], b[k])  # vocab_order, stored as int32
    carried = json.loads(calibration_path(dst).read_text())
    assert carried["weights_sha"] == hash_files([dst]) and carried["compacted_from"] == hash_files([src])
    assert dst.stat().st_size < 0.5 * src.stat().st_size  # tiny matrices: the header and ids weigh more here
    shipped = Path(__file__).resolve().parents[2] / "graphs" / "weights"
    for kind in ("chimera", "medusa", "cerberus"):
        with safe_open(str(shipped / f"{kind}.safetensors"), framework="pt") as fh:
            assert "int8 rows" in json.loads(fh.metadata()["meta"])["storage"]
