"""The GPU check and the torch backend it measures: the dry run of ``scripts/gpu_check.sh`` (CPU torch, the
same stages and JSON as on a GPU), the backend's weights from the bundle, its fairness options, and GPU
tests (marked ``gpu``) that need no model file, since none can travel to the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from specdeploy.exporter.bench.gpu import TINY, Check, prompts, synthetic_manifest
from specdeploy.exporter.bench.gpu_common import Report
from specdeploy.exporter.reference.torch_backend import DeviceRows, TorchBackend
from specdeploy.graphs.base_step import rms_norm
from specdeploy.graphs.native_step import random_weights, step_from_weights
from specdeploy.runtime.bundle import read_manifest
from specdeploy.runtime.capture import chain_feed
from specdeploy.runtime.decode import Decoder, GenerationConfig
from specdeploy.runtime.errors import BackendUnavailableError
from specdeploy.runtime.probe import resolve_plan

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()


def test_dry_run_writes_every_stage_and_the_bench_schema(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], check=False, cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "gpu_check.json", "stages.log", "tests.xml"]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["dry_run"] is True and summary["passed"] is True and summary["failures"] == []
    assert {k: v["rc"] for k, v in summary["stages"].items()} == dict.fromkeys(
        ("env", "setup", "weights", "bench", "tests"), 0)
    assert summary["env"]["torch"] == torch.__version__
    log = (tmp_path / "stages.log").read_text()
    assert "3 parts in" in log and "reassembled" in log and "identical" in log  # the chunked transfer's round trip
    bench = summary["bench"]
    assert bench["errors"] == {}, bench["errors"]
    assert {k: v["status"] for k, v in bench["stages"].items()} == dict.fromkeys(
        ("steps", "decode", "drafts", "identity", "predicted"), "ok")
    assert set(bench["steps"]["fp32-eager"]["ms"]) == {"1", "16", "64"} and bench["steps"]["fp32-eager"]["repeats"] == 5
    assert all(ms > 0 for ms in bench["steps"]["fp32-eager"]["ms"].values())
    assert all(ms > 0 for ms in bench["steps"]["fp32-roofline"]["ms"].values())
    dec = bench["decode"]["fp32"]
    assert dec["ar_tok_s"] > 0 and dec["plan"] and all(dec["speculative_identical_to_plain"])
    assert dec["prompt_lookup_tok_s"] > 0 and dec["speedup_vs_fastest_plain"] > 0
    verdicts = dec["verdicts"]  # every candidate probed until the exact one, each with its verdict
    assert next(iter(verdicts)) == "one-graph" and all({"chains_exact", "trees_exact", "worst"} <= set(v)
                                                     for v in verdicts.values())
    assert dec["lossy"] is (not dec["plan"].startswith("exact speculation"))  # no plan taken: speculation labelled lossy
    drafts = bench["drafts"]["fp32"]
    assert drafts["chimera"]["draft_call_ms"] > 0 and all(drafts["hybrid"]["identical_to_plain"])
    pred = bench["predicted"]["fp32"]
    assert pred["ar"]["speedup_vs_plain"] == 1.0 and pred["prompt-lookup"]["tau_cpu"] > 1.0
    assert pred["chimera"]["draft_ms_from"] == "device" and pred["medusa"]["draft_ms_from"] == "cpu"
    assert summary["tests"]["failures"] == 0 and summary["tests"]["errors"] == 0


@pytest.mark.slow
def test_the_real_stage_decodes_the_embedded_gguf_and_its_drafts_keep_plain_output(tmp_path, real_bundle):
    """The real-weights stage's parts on the embedded GGUF, in this process, at the dry run's sizes (the sweep below
    runs the stage itself): its plan verdicts on the weights read without transformers, exact-tree plans included,
    and on the plan the drafts are measured on, prompt lookup and the shipped drafts in torch (Chimera with its
    taps) equal to plain decoding, on an MT-bench prompt carried as the device gets it."""
    from specdeploy.exporter.bench.gpu_common import timed_decode
    from specdeploy.exporter.bench.gpu_real import RealCheck, measuring_plan, read_gguf, write_prompts
    from specdeploy.exporter.source import default_gguf_path
    from specdeploy.exporter.train.weights import load_draft_weights
    from specdeploy.runtime.drafters import PromptLookupDrafter

    weights, shape = read_gguf(default_gguf_path())
    assert (shape.num_layers, shape.vocab_size) == (30, 49152)
    taps = load_draft_weights(ROOT / "graphs" / "weights" / "chimera.safetensors", "chimera").config.feature_layers
    check = RealCheck(weights, shape, "cpu", max_context=1024, max_tree=4, feature_layers=taps)  # the dry run's
    ids = json.loads(write_prompts(real_bundle, tmp_path / "prompts.json", 1).read_text())["prompts"]
    with check.backend("fp32", False) as backend:
        probed = resolve_plan(backend, check.manifest, use_cache=False)
        names = [r.candidate.name for r in probed.probes]
        assert names[0] == "one-graph" and (probed.trees or any(n.startswith("gathered") for n in names))
        plan = measuring_plan(probed, check.manifest.limits.max_tree, trees_first=False)
        assert plan.exact, plan.reason  # an exact plan, whatever its plain step costs (gathered-padded: by construction)
        plain = timed_decode(check.manifest, backend, plan, None, ids, 16)["tokens"]
        taus = {}
        for name, drafter in [("prompt-lookup", PromptLookupDrafter()), *check.shipped_drafters("fp32", plan.trees)]:
            run = timed_decode(check.manifest, backend, plan, drafter, ids, 16)
            assert run["tokens"] == plain, name
            taus[name] = run["tau"]
    assert {"chimera-chain", "medusa-chain", "cerberus-chain", "auto"} <= set(taus)
    assert all(t >= 1.0 for t in taus.values()) and taus["chimera-chain"] > 1.0, taus  # the drafts were accepted


@pytest.mark.slow
@pytest.mark.sweep
def test_dry_run_real_reads_the_embedded_gguf_and_decodes_it(tmp_path, real_quant_bundle):
    """``--real`` on the CPU: the embedded GGUF through the real-weights stage (its plan verdicts, exact-tree
    plans included, prompt lookup and the shipped drafts equal to plain, on MT-bench prompts carried as the
    device gets them); three files, no bench.json or tests.xml."""
    from specdeploy.exporter.bench.gpu_real import write_prompts

    store = tmp_path / "store"
    store.mkdir()
    write_prompts(real_quant_bundle("q4_1"), store / "prompts.json", 2)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "SPECDEPLOY_GPU_STORE": str(store)}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--real"], check=False, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "real.json", "stages.log"]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["passed"] and summary["real"] and set(summary["stages"]) == {"env", "setup", "weights", "real"}
    real = summary["real"]
    assert {k: v["status"] for k, v in real["stages"].items()} == {"load": "ok", "decode": "ok", "drafts": "ok"}
    assert real["load"]["shape"]["num_layers"] == 30 and real["load"]["shape"]["vocab_size"] == 49152
    assert real["load"]["prompts"] == "MT-bench, chat template"
    dec = real["decode"]["fp32"]
    assert "one-graph" in dec["verdicts"] and (dec["trees"] or any(n.startswith("gathered") for n in dec["verdicts"]))
    assert all(dec["speculative_identical_to_plain"]) and dec["ar_tok_s"] > 0
    # the shipped drafts in torch (Chimera with its taps), on an exact plan: where the probe's does not
    # speculate at a plain step's cost, the first exact one, each output against plain decoding on it
    drafts = real["drafts"]["fp32"]
    assert drafts["plan"].startswith("exact speculation") and drafts["plain_tok_s"] > 0
    runs = {k: v for k, v in drafts.items() if isinstance(v, dict)}
    assert {"chimera-chain", "medusa-chain", "cerberus-chain", "auto"} <= set(runs)
    assert dec["eager"]["prompts"] == 1 and dec["eager"]["ar_tok_s"] > 0  # end to end without CUDA graphs too
    assert all(all(r["identical_to_plain"]) and not r["lossy"] and r["tau"] >= 1.0 for r in runs.values())
    assert runs["chimera-chain"]["tau"] > 1.0  # drafts accepted (its taps: test_the_torch_chimera_reads_its_taps)
    assert ("chimera-tree16" in runs) == drafts["trees"]


@pytest.mark.slow
def test_the_gguf_reader_gives_the_exporters_weights_bit_for_bit():
    """The device's GGUF reader (no transformers) builds the step the exporter builds from transformers' load
    of the same file: equal weights, equal logits."""
    from specdeploy.exporter.bench.gpu_real import read_gguf
    from specdeploy.exporter.source import load_model
    from specdeploy.graphs.base_step import BaseStep, example_inputs

    loaded = load_model(None)
    weights, shape = read_gguf(Path(loaded.path))
    mine, ref = step_from_weights(weights, shape).eval(), BaseStep(loaded.model).eval()
    assert shape.rms_norm_eps == loaded.model.config.rms_norm_eps and shape.num_kv_heads == 3
    for a, b in zip(ref.blocks, mine.blocks):
        assert torch.equal(a.qkv.weight, b.qkv.weight) and torch.equal(a.down_proj.weight, b.down_proj.weight)
    inputs = example_inputs(ref, batch=2, t=5, capacity=32)
    with torch.no_grad():
        want = ref(*inputs[:5], [x.clone() for x in inputs[5]])
        got = mine(*inputs[:5], [x.clone() for x in inputs[5]])
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_the_real_stage_says_what_is_missing_in_one_sentence(tmp_path):
    run = subprocess.run([sys.executable, "-m", "specdeploy.exporter.bench.gpu_real", "run", str(tmp_path / "r.json"),
                          "--gguf", str(tmp_path / "none.gguf"), "--dry-run"], check=False, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "There is no GGUF at" in run.stderr and "Traceback" not in run.stderr
    from specdeploy.exporter.export.gguf_blocks import gguf_row_order

    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of 8 rows, llama.cpp's order undone
    perm = w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)  # what llama.cpp's converter does
    assert np.array_equal(perm[gguf_row_order(16, 2)], w)
    from specdeploy.runtime.architectures import gguf_architecture
    from specdeploy.runtime.errors import UnsupportedArchitectureError

    assert gguf_architecture("llama").gguf_qk_permuted and not gguf_architecture("qwen2").gguf_qk_permuted
    with pytest.raises(UnsupportedArchitectureError, match="holds a 'falcon' model; specdeploy supports"):
        gguf_architecture("falcon", "x.gguf")


def test_a_failing_stage_fails_the_check_and_says_why(tmp_path):
    """The bench dies: the script exits non-zero and gpu_check.json names the stage and the reason."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/usr/bin/env bash\ncase \"$*\" in *\"exporter.bench.gpu \"*) echo 'bench broke' >&2; exit 3;; "
                    f"esac\nexec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake)}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], check=False, cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 1, run.stderr[-2000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["passed"] is False and summary["stages"]["bench"]["rc"] == 3
    assert "stage bench: exit code 3 (stages.log)" in summary["failures"] and "bench: no bench.json" in summary["failures"]
    assert "bench broke" in (out / "stages.log").read_text() and "FAILED" in run.stderr


def test_a_stage_that_raises_skips_what_builds_on_it_and_exits_1(tmp_path, monkeypatch, capsys):
    from specdeploy.exporter.bench import gpu

    def broken(*args, **kwargs):
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(gpu, "resolve_plan", broken)
    with pytest.raises(SystemExit) as exc:
        gpu.main([str(tmp_path / "b.json"), "--dry-run", "--max-new-tokens", "4", "--num-prompts", "1"])
    assert exc.value.code == 1
    saved = json.loads((tmp_path / "b.json").read_text())
    assert {k: v["status"] for k, v in saved["stages"].items()} == {
        "steps": "ok", "decode": "error", "drafts": "skipped", "identity": "skipped", "predicted": "ok"}
    assert "the probe broke" in saved["errors"]["decode"] and "decode" in saved["errors"]["drafts"]
    err = capsys.readouterr().err
    assert "decode, drafts, identity did not pass" in err and "Traceback" not in err


def test_an_exact_plan_whose_output_leaves_plain_fails_the_stage():
    from specdeploy.exporter.bench.gpu_common import require_lossless
    from specdeploy.runtime.plan import Candidate, StepPlan

    exact = StepPlan(Candidate("one-graph", False, 1), True, True, True, 16, "exact")
    entry: dict = {}
    require_lossless(entry, exact, [True, True], "fp32 lookup")
    assert entry["lossy"] is False
    with pytest.raises(AssertionError, match="left plain decoding on 1 of 2 prompts"):
        require_lossless(entry, exact, [True, False], "bf16 lookup")
    lossy = StepPlan(Candidate("one-graph", False, 1), True, False, True, 16, "LOSSY")
    require_lossless(entry, lossy, [True, False], "bf16 lookup")  # labelled lossy: recorded, not a failure
    assert entry["lossy"] is True


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU message")
def test_the_gpu_bench_without_a_gpu_is_one_sentence(tmp_path):
    run = subprocess.run([sys.executable, "-m", "specdeploy.exporter.bench.gpu", str(tmp_path / "b.json")],
                         check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == ("error: The GPU check needs a CUDA GPU and PyTorch sees none; pass --dry-run to "
                                  "run its stages on the CPU.")
    assert not (tmp_path / "b.json").exists()


def test_report_records_a_failing_stage_and_goes_on(tmp_path):
    rep = Report(tmp_path / "r.json", {"device": "cpu"})
    assert json.loads((tmp_path / "r.json").read_text())["stages"] == {}  # written before any stage
    with rep.stage("first") as res:
        res["x"] = 1
        raise RuntimeError("boom")
    with rep.stage("second") as res:
        res["y"] = 2
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["stages"]["first"]["status"] == "error" and "boom" in saved["errors"]["first"]
    assert saved["stages"]["second"]["status"] == "ok" and saved["second"] == {"y": 2} and saved["first"] == {"x": 1}


def test_torch_backend_reads_the_bundles_weights_without_transformers(tiny_bundle):
    code = f"""
import sys
import numpy as np
from specdeploy.exporter.reference.torch_backend import TorchBackend
from specdeploy.runtime.capture import chain_feed
from specdeploy.runtime.bundle import read_manifest
m = read_manifest({str(tiny_bundle)!r})
with TorchBackend({str(tiny_bundle)!r}, m, device="cpu", cuda_graphs=False) as b:
    cache = b.new_cache(1, 128)
    out = b.step(chain_feed(np.array([5, 6, 7]), 0, 128, np.arange(3)), cache)
    assert out.argmax.tolist() == [np.asarray(out.logits)[0].argmax(-1).tolist()]
print("transformers" in sys.modules)
"""
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"


def test_torch_backend_refuses_a_bundle_without_fp32_weights(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    only_trt = manifest.replace(graphs=tuple(g for g in manifest.graphs if g.target == "trt"))
    with pytest.raises(BackendUnavailableError, match=r"fp32 'ort' graph.*it has: trt/fp32.*--precision fp32"):
        TorchBackend(tiny_bundle, only_trt, device="cpu", cuda_graphs=False)


def test_half_precision_rms_norm_squares_in_fp32():
    x = torch.full((1, 8), 300.0)  # 300^2 overflows fp16 (max 65504)
    w = torch.full((8,), 0.5)
    ref = rms_norm(x, w, 1e-5)
    half = rms_norm(x.half(), w.half(), 1e-5)
    assert torch.isfinite(half).all() and torch.allclose(half.float(), ref, atol=1e-3)
    naive = x.half() / torch.sqrt(x.half().pow(2).mean(-1, keepdim=True) + 1e-5) * w.half()
    assert not torch.allclose(naive.float(), ref, atol=1e-3)  # what the upcast prevents


def test_inplace_kv_and_sdpa_compute_the_export_form():
    """The torch backend's options (cache written in place, fused attention) give the exported form's logits,
    and leave in the cache buffers what the exported form returns as ``present``."""
    step = step_from_weights(random_weights(TINY, seed=3, std=0.1), TINY).eval()
    cap, past_len, t = 32, 5, 4
    feed = chain_feed(np.arange(10, 10 + t), past_len, cap, np.arange(t))
    args = [torch.from_numpy(getattr(feed, n)) for n in ("input_ids", "position_ids", "attention_mask",
                                                          "write_indices", "logits_index")]
    past = [torch.randn(1, TINY.num_kv_heads, cap, TINY.head_dim, generator=torch.Generator().manual_seed(i))
            for i in range(2 * TINY.num_layers)]
    with torch.no_grad():
        logits, hidden, *presents = step(*args, [p.clone() for p in past])
        step.inplace_kv, step.sdpa = True, True
        bufs = [p.clone() for p in past]
        logits2, hidden2, *_ = step(*args, bufs)
    assert torch.allclose(logits, logits2, atol=1e-5) and torch.allclose(hidden, hidden2, atol=1e-5)
    for buf, present in zip(bufs, presents, strict=True):
        assert torch.allclose(buf, present, atol=1e-6)


def test_device_rows_copies_only_what_is_read():
    t = torch.arange(24, dtype=torch.float32).reshape(1, 4, 6)
    rows = DeviceRows(t)
    assert rows.shape == (1, 4, 6) and rows.ndim == 3 and len(rows) == 1
    sub = rows[0]
    assert isinstance(sub, DeviceRows) and sub.shape == (4, 6)  # still on the device
    row = sub[2]
    assert isinstance(row, np.ndarray) and row.tolist() == t[0, 2].tolist()
    assert rows[0, np.array([1, 3])].shape == (2, 6)
    assert np.array_equal(np.asarray(rows), t.numpy()) and (sub / 2.0).tolist() == (t[0] / 2).tolist()
    assert sub.max() == 23.0 and sub.astype(np.float64).dtype == np.float64


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_decoding_with_a_torch_draft(precision):
    """fp16/bf16 steps go through the exactness probe (bf16 caches are widened for it) and the torch Chimera
    drafter runs in the base's precision (its fp32 rotary tables cast), as on a GPU."""
    from specdeploy.exporter.bench.gpu import draft_call_ms
    from specdeploy.exporter.bench.gpu_common import timed_decode

    check = Check(TINY, "cpu", max_context=128, max_tree=16)
    ids = prompts(TINY, 1, 24)
    with check.backend(precision, False) as backend:
        plan = resolve_plan(backend, check.manifest, use_cache=False)
        plain = timed_decode(check.manifest, backend, plan, None, ids, 8)
        assert len(plain["tokens"][0]) == 8 and plain["plan"]
        for name, drafter in check.drafters(precision):
            run = timed_decode(check.manifest, backend, plan, drafter, ids, 8)
            assert run["tokens"] == plain["tokens"]  # the plan speculates only where exact
            if name == "chimera":
                assert drafter.graph.embed_weight.dtype == backend.dtype
                assert draft_call_ms(drafter, TINY, ids[0], 2) > 0


def test_top_k_sampling_reads_back_only_the_top_k_and_samples_the_same():
    from specdeploy.runtime.tree import DraftTree
    from specdeploy.runtime.verify import sample_accept

    class TopOnly(DeviceRows):  # fails if sampling reads a whole row instead of its top-k
        def __getitem__(self, index):
            raise AssertionError("a whole row was read")

    assert DeviceRows(torch.tensor([[0.0, 5.0, 1.0, 4.0]])).top_row(0, 2).tolist() == [-np.inf, 5.0, -np.inf, 4.0]
    assert DeviceRows(torch.tensor([[0.0, 5.0, 4.0, 4.0]])).top_row(0, 2).tolist() == [0.0, 5.0, 4.0, 4.0]  # a tie
    rng = np.random.default_rng(0)
    accepted = 0
    for case in range(60):
        logits = rng.normal(size=(4, 50)).astype(np.float32)
        if case % 3 == 0:
            logits[:, :6] = 2.5  # ties at the top-k cut
        tokens = np.array([7, *(int(logits[i].argmax()) for i in range(3))])  # a chain the base likes
        tree = DraftTree(tokens, np.array([-1, 0, 1, 2]))
        for top_k in (1, 3, 8):
            args = {"temperature": 0.8, "top_k": top_k}
            want = sample_accept(tree, tree.buffers(), logits, np.random.default_rng(case), **args)
            got = sample_accept(tree, tree.buffers(), TopOnly(torch.from_numpy(logits)), np.random.default_rng(case),
                                **args)
            assert got.nodes.tolist() == want.nodes.tolist() and got.tokens.tolist() == want.tokens.tolist()
            accepted += len(want.nodes) - 1
    assert accepted > 0


def test_capture_all_captures_nothing_on_a_cpu():
    check = Check(TINY, "cpu", max_context=128, max_tree=16)
    with check.backend("fp32", False) as backend:
        assert backend.capture_all() == 0


# --- on a GPU (scripts/gpu_check.sh runs these; no model file needed) ------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_graphs_are_all_captured_before_decoding_and_match_eager():
    check = Check(TINY, "cuda", max_context=256, max_tree=16)
    ids = prompts(TINY, 2, 24)
    tokens = {}
    for graphs in (False, True):
        with check.backend("fp32", graphs) as backend:
            captured = backend.capture_all()
            if graphs:
                assert captured == sum(1 for c in backend.cap_buckets for t in backend.t_buckets if 1 + t <= c)
            dec = Decoder(backend, check.manifest, None, plan=resolve_plan(backend, check.manifest, use_cache=False))
            tokens[graphs] = [list(dec.generate(p, GenerationConfig(max_new_tokens=32))) for p in ids]
            assert backend.captures == captured  # decoding replayed only graphs captured beforehand
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_synthetic_manifest_runs_the_real_architecture_on_the_device():
    from specdeploy.exporter.bench.gpu import SMOLLM2_135M

    check = Check(SMOLLM2_135M, "cuda", max_context=512, max_tree=16)
    assert check.manifest == synthetic_manifest(SMOLLM2_135M, 512, 16)
    with check.backend("bf16", True) as backend:
        cache = backend.new_cache(1, backend.cap_buckets[0])
        out = backend.step(chain_feed(np.arange(100, 140), 0, cache.capacity, np.arange(39, 40)), cache)
        assert np.isfinite(np.asarray(out.logits)).all() and out.hidden_states.shape == (1, 40, 576)
        assert check.step_ms(backend, 16, 64, 5) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torch_drafts_on_the_device_keep_plain_output(precision):
    from specdeploy.exporter.bench.gpu_common import timed_decode

    check = Check(TINY, "cuda", max_context=256, max_tree=16)
    ids = prompts(TINY, 2, 24)
    with check.backend(precision, True) as backend:
        backend.capture_all()
        plan = resolve_plan(backend, check.manifest, use_cache=False)
        plain = timed_decode(check.manifest, backend, plan, None, ids, 32)
        for _, drafter in check.drafters(precision):
            assert timed_decode(check.manifest, backend, plan, drafter, ids, 32)["tokens"] == plain["tokens"]


def test_the_padded_probe_experiment_runs_its_dry_run(tmp_path):
    """scripts/experiments/gpu_padded_probe.py (docs/benchmarks.md cites its H200 figures) on CPU torch."""
    out = tmp_path / "p.json"
    run = subprocess.run([sys.executable, "scripts/experiments/gpu_padded_probe.py", str(out), "--dry-run",
                          "--num-prompts=2"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    mode = json.loads(out.read_text())["modes"]["fp32-eager"]
    assert list(mode["probe"]) == ["one-graph", "two-rows", "padded-16"]
    pad = mode["padded16"]
    if pad["exact"]:
        assert all(pad["identical_to_padded_plain"])
    assert pad["prompt_lookup_tok_s"] > 0 and pad["ar_tok_s"] > 0


def test_the_torch_chimera_reads_its_taps():
    """A fusing Chimera (EAGLE-3 taps) in torch, as the exported graph computes it: real slots read the fused
    taps (``FusedChimeraStepGraph`` with ``from_layers`` 1), chain slots the fed-back feature."""
    from specdeploy.exporter.reference.torch_drafters import TorchChimeraDrafter
    from specdeploy.graphs.chimera import ChimeraConfig, ChimeraDraft, FusedChimeraStepGraph

    torch.manual_seed(0)
    cfg = ChimeraConfig("chimera", 3, 16, 50, 4, 2, 4, 24, feature_layers=(0, 1))
    graph = FusedChimeraStepGraph(ChimeraDraft(cfg), torch.randn(50, 16), torch.randn(50, 16), 5)
    with torch.no_grad():
        for p in graph.draft.parameters():
            p.normal_(0.0, 0.3)
    drafter = TorchChimeraDrafter(graph, "cpu", torch.float32, topk=5)
    assert drafter.feature_layers == (0, 1)
    seen, step = [], graph.step
    graph.step = lambda x, *rest: seen.append(x.clone()) or step(x, *rest)
    rng = np.random.default_rng(0)
    hidden, layers = rng.normal(size=(4, 16)).astype(np.float32), rng.normal(size=(4, 32)).astype(np.float32)
    drafter.head_topk(np.array([3, 7, 9, 11, 4]), hidden, layers=layers)
    want = graph.draft.fusion(torch.from_numpy(layers)[None])  # what the graph blends in at from_layers = 1
    assert len(seen) == 3 and torch.allclose(seen[0], want, atol=1e-6)  # the real slots: the taps, fused
    assert not torch.allclose(seen[0], torch.from_numpy(hidden)[None])
    assert all(x.shape == (1, 1, 16) for x in seen[1:])  # each chain slot: one fed-back feature
