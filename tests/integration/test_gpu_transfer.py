"""The chunked route for a file too large for one call to the GPU machine (exporter/bench/gpu_transfer.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from specdeploy.exporter.bench.gpu_transfer import (
    CALL_LIMIT,
    MIB,
    TransferError,
    join,
    plan,
    split,
    stash,
    tree_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


def _send(tmp_path: Path, data: bytes, part: int) -> tuple[Path, list[Path]]:
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    parts = split(src, tmp_path / "parts", part)
    return src, parts


def test_parts_travel_over_calls_and_join_to_the_same_bytes(tmp_path):
    data = bytes(range(256)) * 4099  # not a multiple of the part size
    _, parts = _send(tmp_path, data, 100_000)
    assert len(parts) == 11 and all(p.stat().st_size <= 100_000 for p in parts)
    store = tmp_path / "store"
    for i, part in enumerate(parts):  # one part per call, the manifest with the first
        call = tmp_path / f"call{i}"
        call.mkdir()
        part.rename(call / part.name)
        if i == 0:  # the manifest, and the real-weights stage's prompts, ride with the first part
            (tmp_path / "parts" / "parts.json").rename(call / "parts.json")
            (call / "prompts.json").write_text('{"prompts": [[1, 2]]}')
            (call / "stray.txt").write_text("not carried on")
        last = i == len(parts) - 1
        if last:  # the device training's prompts ride with the last, smallest part
            (call / "train-prompts.npz").write_bytes(b"ids")
        assert stash(call, store) == sorted([part.name] + (["parts.json", "prompts.json"] if i == 0 else []) +
                                            (["train-prompts.npz"] if last else []))
    assert join(store, tmp_path / "joined.gguf").read_bytes() == data
    assert json.loads((store / "prompts.json").read_text())["prompts"] == [[1, 2]]
    assert (store / "train-prompts.npz").read_bytes() == b"ids" and not (store / "stray.txt").exists()


@pytest.mark.slow
def test_the_real_stage_prompts_are_mtbench_in_the_chat_template(real_quant_bundle, tmp_path):
    from specdeploy.exporter.bench.gpu_real import write_prompts
    from specdeploy.runtime import load
    from tiny_training import mtbench_first_turns

    out = write_prompts(real_quant_bundle("q4_1"), tmp_path / "prompts.json", 3)
    ids = json.loads(out.read_text())["prompts"]
    with load(real_quant_bundle("q4_1"), draft=None) as engine:
        assert ids == [engine.encode(p, chat=True) for p in mtbench_first_turns(3)]


def test_a_missing_or_corrupt_part_is_one_sentence_and_leaves_no_file(tmp_path):
    _, parts = _send(tmp_path, b"x" * 1000 + b"y" * 1000, 700)
    store = tmp_path / "parts"
    parts[1].unlink()
    with pytest.raises(TransferError, match=r"1 of 3 parts never arrived \(part-001\)"):
        join(store, tmp_path / "out.gguf")
    parts[1].write_bytes(b"z" * 700)
    with pytest.raises(TransferError, match="Part part-001 is corrupt"):
        join(store, tmp_path / "out.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "parts"]  # nothing half-written
    with pytest.raises(TransferError, match="no readable parts.json"):
        join(tmp_path / "nowhere", tmp_path / "out.gguf")


def test_the_tree_and_one_part_fit_in_a_call():
    from specdeploy.exporter.train.ondevice import PROMPTS_BOUND

    tree = tree_bytes(ROOT)
    size = 94 * MIB
    tp = plan(size, tree)
    assert tp.tree_bytes == tree and tree + tp.part_bytes + 64 * 1024 <= CALL_LIMIT  # the first, with prompts.json
    assert tp.fits() == (tp.part_bytes >= 4 * MIB)
    last = size - (tp.calls - 1) * tp.part_bytes  # the last part carries train-prompts.npz (prepare bounds it)
    assert tp.calls == 3 and tree + last + PROMPTS_BOUND <= CALL_LIMIT
    assert plan(94 * MIB, 20 * MIB).calls == 3 and plan(94 * MIB, 20 * MIB).fits()


def test_the_cli_refuses_a_transfer_the_tree_leaves_no_room_for(tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(b"0" * 1024)
    cmd = [sys.executable, "-m", "specdeploy.exporter.bench.gpu_transfer"]
    run = subprocess.run([*cmd, "split", str(src), str(tmp_path / "p")], check=False, capture_output=True, text=True, timeout=120)
    if plan(1024, tree_bytes(ROOT)).fits():
        assert run.returncode == 0 and json.loads((tmp_path / "p" / "parts.json").read_text())["bytes"] == 1024
    else:
        assert run.returncode == 2 and "slim the tree first" in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run([*cmd, "plan", str(src)], check=False, capture_output=True, text=True, timeout=120)
    assert run.stdout.startswith("tree ") and "calls for" in run.stdout and "Traceback" not in run.stderr
    run = subprocess.run([*cmd, "join", str(tmp_path / "none"), str(tmp_path / "o")], check=False, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("error: ") and "Traceback" not in run.stderr
