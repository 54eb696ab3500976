"""Draft training on the device, prepared (exporter/train/ondevice.py): the prompts as ids made here, the data and
both drafts made from the GGUF alone (on the CPU: a small run here, and as a sweep the dry run of
scripts/gpu_check.sh --train), and the keep step that lets a new draft replace a shipped one only where it accepts
more."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from specdeploy.exporter.train import ondevice
from specdeploy.exporter.train.weights import load_draft_weights
from specdeploy.runtime.errors import BundleError, TrainingError

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "graphs" / "weights"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Training prompts as ``prepare`` writes them (8 of the selected ShareGPT first turns, replies of 32 tokens)."""
    return ondevice.prepare(tmp_path_factory.mktemp("prompts") / "p.npz", max_seqs=8, reply_tokens=32,
                            log=lambda m: None)


# The default tier trains on 4 of those prompts, a step or so per draft: each stage of the device's run on the real
# GGUF, in this process. The sweep runs it as the device does (scripts/gpu_check.sh --dry-run --train: 12 of 48).
SMALL = replace(ondevice.DRY_RUN, max_seqs=4, heldout_fraction=0.5, chimera_s=3, cerberus_s=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prepared) -> Path:
    """``ondevice.run``'s output folder: the data and both drafts from the embedded GGUF (CPU torch, fp32)."""
    from specdeploy.exporter.source import default_gguf_path

    out = tmp_path_factory.mktemp("ondevice")
    rep = ondevice.run(out, default_gguf_path(), prepared, dry_run=True, budget=SMALL, log=lambda m: None)
    assert not rep.failed, json.dumps(rep.data.get("errors"))[-3000:]
    return out


def _check_trained(out: Path, train: dict, sequences: int, of_prompts: int) -> None:
    """Every stage passed, on the data asked for, and each draft is one the exporter takes, of the shipped one's
    shape, tied to the GGUF's weights."""
    from specdeploy.exporter.source import default_gguf_path, file_sha

    assert {k: v["status"] for k, v in train["stages"].items()} == dict.fromkeys(
        ("load", "data", "chimera", "cerberus"), "ok")
    data = train["data"]
    assert data["sequences"] == sequences and data["of_prompts"] == of_prompts and data["heldout_sequences"] >= 1
    assert data["reply_positions"] > sequences * 8 and data["engine"].startswith("torch fp32 on the CPU")
    sha = file_sha(default_gguf_path())
    for kind in ondevice.KINDS:
        path = out / f"{kind}.safetensors"
        assert path.stat().st_size < ondevice.MAX_FILE_BYTES == 16 << 20
        draft = load_draft_weights(path, kind)  # a draft the exporter takes, tied to the GGUF's weights
        shipped = load_draft_weights(WEIGHTS / f"{kind}.safetensors", kind)
        assert draft.config.base_weight_sha == sha == shipped.config.base_weight_sha
        assert draft.config == shipped.config  # the shipped one's shape, taps included
        assert train[kind]["steps"] >= 1 and "heldout_positions" in train[kind]["final"]


def test_training_makes_both_drafts_from_the_gguf_alone(trained):
    assert sorted(p.name for p in trained.iterdir()) == ["cerberus.safetensors", "chimera.safetensors", "train.json"]
    _check_trained(trained, json.loads((trained / "train.json").read_text()), 4, 8)


@pytest.mark.sweep
def test_the_dry_run_trains_both_drafts_from_the_gguf_alone(tmp_path):
    """``gpu_check.sh --dry-run --train`` end to end: the prompts prepared inside its train stage, as on the device."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--train"], check=False, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:] + (tmp_path / "stages.log").read_text()[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cerberus.safetensors", "chimera.safetensors",
                                                          "gpu_check.json", "stages.log", "train.json"]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["passed"] and summary["train"] and not summary["real"]
    assert set(summary["stages"]) == {"env", "setup", "weights", "train"}
    _check_trained(tmp_path, summary["train"], 12, 48)


def test_the_prompts_are_those_training_selects(prepared):
    from specdeploy.exporter.source import load_model
    from specdeploy.exporter.train.cache import data_config
    from specdeploy.exporter.train.sharegpt import select_sequences

    prep = ondevice.Prepared.read(prepared)
    loaded = load_model(None)
    taps = tuple(load_draft_weights(WEIGHTS / "chimera.safetensors").config.feature_layers)
    want = list(select_sequences(loaded.tokenizer, data_config(8, 512, 0, "self", 32, feature_layers=taps)))
    assert prep.conversation_ids == [c.id for c, _, _ in want]
    assert [p.tolist() for p in prep.prompts] == [ids.tolist() for _, ids, _ in want]
    assert prep.weight_sha == loaded.weight_sha and prep.data["feature_layers"] == list(taps)
    assert set(prep.eos_token_ids) >= {loaded.tokenizer.eos_token_id} and prep.token_counts.sum() > 10_000


def test_another_gguf_or_a_bad_prompts_file_is_one_sentence(prepared, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(64))
    prompts = prepared
    rep = ondevice.run(tmp_path / "out", other, prompts, dry_run=True)
    assert rep.failed == ["load", "data", "chimera", "cerberus"]
    assert "is not the model the prompts were prepared for" in rep.data["errors"]["load"]
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(TrainingError, match="is not a prepared prompts file"):
        ondevice.Prepared.read(bad)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.json"]  # no weights half-made
    with pytest.raises(BundleError, match="No bundle directory at"):  # before any work
        ondevice.keep(tmp_path, tmp_path / "nowhere", tmp_path / "keep.json", dest=tmp_path)
    assert not (tmp_path / "keep.json").exists()
    run = subprocess.run([sys.executable, "-m", "specdeploy.exporter.train.ondevice", "run", str(tmp_path / "o2"),
                          "--gguf", str(other), "--prompts", str(prompts)], check=False, capture_output=True, text=True,
                         timeout=300)
    if not torch.cuda.is_available():
        assert run.returncode == 2 and run.stderr.strip() == (
            "error: Training on the device needs a CUDA GPU and PyTorch sees none; pass --dry-run to run it on the "
            "CPU.")


def test_keep_lets_a_new_draft_in_only_where_it_accepts_more(trained, real_quant_bundle, tmp_path):
    bundle = real_quant_bundle("q4_1")
    shipped = WEIGHTS / "cerberus.safetensors"
    # the barely trained draft against the shipped one: the shipped one stays, untouched
    dest, new = tmp_path / "dest", tmp_path / "new"
    dest.mkdir(), new.mkdir()
    for f in WEIGHTS.glob("cerberus.*"):
        shutil.copyfile(f, dest / f.name)
    shutil.copyfile(trained / "cerberus.safetensors", new / "cerberus.safetensors")
    before = {f.name: f.read_bytes() for f in dest.iterdir()}
    result = ondevice.keep(new, bundle, tmp_path / "keep.json", dest=dest, num_prompts=2, tokens=24,
                           log=lambda m: None)
    entry = result["kinds"]["cerberus"]
    assert not entry["kept"] and entry["shipped_tau"] > entry["new_tau"] >= 1.0
    assert {f.name: f.read_bytes() for f in dest.iterdir()} == before
    assert json.loads((tmp_path / "keep.json").read_text()) == result and (tmp_path / "keep.png").stat().st_size
    # the other way round: the better draft replaces the worse one, recalibrated on this machine
    dest2, new2 = tmp_path / "dest2", tmp_path / "new2"
    dest2.mkdir(), new2.mkdir()
    shutil.copyfile(trained / "cerberus.safetensors", dest2 / "cerberus.safetensors")
    shutil.copyfile(shipped, new2 / "cerberus.safetensors")
    calibrate = {"prompts": 2, "max_new_tokens": 16, "confirm_prompts": 1, "trees": ("chain4", "tree16")}
    result = ondevice.keep(new2, bundle, tmp_path / "keep2.json", dest=dest2, num_prompts=2, tokens=24,
                           calibrate=calibrate, log=lambda m: None)
    assert result["kinds"]["cerberus"]["kept"]
    kept, want = load_draft_weights(dest2 / "cerberus.safetensors"), load_draft_weights(shipped)
    heads = [k for k in want.tensors if k.startswith("heads.")]
    assert heads and all(np.array_equal(kept.tensors[k].numpy(), want.tensors[k].numpy()) for k in heads)
    assert (dest2 / "cerberus.calibration.json").is_file()
