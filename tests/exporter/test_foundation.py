"""Export, parity, manifest and bad-input tests on tiny random Llama, Mistral and Qwen2 models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from specdeploy.exporter.cli import main
from specdeploy.runtime import load
from specdeploy.runtime.bundle import SCHEMA_VERSION, BundleManifest, read_manifest
from specdeploy.runtime.errors import (
    BundleError,
    BundleExistsError,
    ModelSourceError,
    PromptError,
    UnsupportedArchitectureError,
)

ARCHS = ["llama", "mistral", "qwen2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_export_and_parity(arch, tiny_bundle_factory, tiny_model_factory):
    from specdeploy.exporter.check.validate import validate_bundle

    bundle = tiny_bundle_factory(arch)
    manifest = read_manifest(bundle)
    base = manifest.graph("base")
    names = [s.name for s in base.inputs]
    assert names[:5] == ["input_ids", "position_ids", "attention_mask", "write_indices", "logits_index"]
    assert [s.name for s in base.outputs][:2] == ["logits", "hidden_states"]
    assert base.inputs[0].shape == ("batch", "tree") and base.inputs[5].shape[2] == "capacity"
    lines: list[str] = []
    checks = validate_bundle(bundle, str(tiny_model_factory(arch)), progress=lines.append)
    assert {c.case for c in checks} == {f"{case}{tag}" for case in ("prefill", "step", "tree") for tag in ("", "[ort]", "[ort-tree]")}
    assert all(c.passed for c in checks)
    assert all(c.argmax_agree for c in checks if c.output == "logits")
    # The step-plan probe's report: every candidate, then the runtime's choice (runtime/plan_choice.py).
    plans = [line for line in lines if line.lstrip().startswith("plan ")]
    depth = min(16, manifest.limits.max_tree)
    assert [p.split()[1] for p in plans] == ["one-graph", "two-rows", f"padded-{depth}", "gathered",
                                             "gathered-two-rows", f"gathered-padded-{depth}"]
    gathered = next(p for p in plans if p.split()[1] == "gathered")
    assert "trees exact" in gathered or "trees differ" in gathered  # the tree verdict is stated
    assert sum(line.lstrip().startswith("runtime: ") for line in lines) == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tiny_bundle_factory, tiny_model_factory):
    import torch
    from transformers import AutoModelForCausalLM

    bundle = tiny_bundle_factory(arch)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch), dtype=torch.float32).eval()
    with load(bundle, draft=None) as engine:
        ids = engine.encode("The weather today is")
        ours = engine.generate_ids(ids, __import__("specdeploy.runtime.decode", fromlist=["x"]).GenerationConfig(16))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=2)
    assert ours == ref[0, len(ids):].tolist()[: len(ours)]


def test_manifest_round_trip(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    again = BundleManifest.from_json(manifest.to_json())
    assert again == manifest
    assert again.schema_version == SCHEMA_VERSION
    assert dict(again.versions)["onnx"]


def _copy_bundle(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_an_older_bundle_with_the_batching_graph_still_loads_and_runs_none_of_it(tiny_bundle, tmp_path):
    """Bundles exported before ``base-batch.onnx`` was dropped list it (target 'ort-batch') after the fused graph:
    they load, and the backend runs the fused and exact-tree graphs, batching on the latter, as on a new bundle."""
    import shutil

    from specdeploy.runtime.decode import GenerationConfig

    old = _copy_bundle(tiny_bundle, tmp_path / "old")
    shutil.copyfile(old / "base-tree.onnx", old / "base-batch.onnx")  # same bytes and weights: the same hash
    raw = json.loads((old / "manifest.json").read_text())
    tree = next(g for g in raw["graphs"] if g["target"] == "ort-tree")
    at = 1 + next(i for i, g in enumerate(raw["graphs"]) if g["target"] == "ort")
    raw["graphs"].insert(at, {**tree, "file": "base-batch.onnx", "target": "ort-batch", "rows_apart": False})
    (old / "manifest.json").write_text(json.dumps(raw))
    manifest = read_manifest(old)  # every listed file verified
    assert manifest.find_graph("base", "ort-batch").file == "base-batch.onnx"
    assert manifest.tree_graph().file == "base-tree.onnx"
    with load(old, draft=None) as engine:
        backend = engine.backend
        assert (backend.graph.file, backend.tree_graph.file) == ("base-ort.onnx", "base-tree.onnx")
        assert backend.one_row_graph is None and backend.can_batch_rows
        assert len(engine.generate_ids(engine.encode("The weather today is"), GenerationConfig(8))) == 8


def test_corrupt_bundles_are_refused(tiny_bundle, tmp_path):
    missing = _copy_bundle(tiny_bundle, tmp_path / "missing")
    (missing / "base.onnx").unlink()
    with pytest.raises(BundleError, match="missing"):
        load(missing, draft=None)

    changed = _copy_bundle(tiny_bundle, tmp_path / "changed")
    data = changed / "base.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="do not match the hash"):
        load(changed, draft=None)

    newer = _copy_bundle(tiny_bundle, tmp_path / "newer")
    m = json.loads((newer / "manifest.json").read_text())
    m["schema_version"] = SCHEMA_VERSION + 1
    (newer / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="newer"):
        load(newer, draft=None)

    garbage = _copy_bundle(tiny_bundle, tmp_path / "garbage")
    (garbage / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        load(garbage, draft=None)

    with pytest.raises(BundleError, match="No bundle directory"):
        load(tmp_path / "nope", draft=None)


def test_bad_model_sources(tmp_path):
    from specdeploy.exporter.export.base import export_base

    with pytest.raises(ModelSourceError, match="does not exist"):
        export_base(str(tmp_path / "missing"), tmp_path / "out")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        export_base(str(gpt2), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "weights.bin").write_bytes(b"xx")
    with pytest.raises(ModelSourceError, match="neither"):
        export_base(str(tmp_path / "weights.bin"), tmp_path / "out")


def test_force_and_interrupted_export_leave_nothing_half_written(tiny_bundle, tiny_model_factory, tmp_path,
                                                                  monkeypatch):
    from specdeploy.exporter.export import base as export_mod

    out = tmp_path / "b"
    out.mkdir()
    with pytest.raises(BundleExistsError, match="--force"):
        export_mod.export_base(str(tiny_model_factory("llama")), out)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_mod, "export_graph", interrupted)
    fresh = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        export_mod.export_base(str(tiny_model_factory("llama")), fresh)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no partial bundle, no temp dir


def test_full_disk_is_one_sentence_and_leaves_nothing(tiny_bundle, tiny_model_factory, tmp_path, monkeypatch):
    """ENOSPC mid-export (a real CI failure) becomes a BundleError naming the path; the partial files go."""
    import errno

    from specdeploy.exporter.export import base as export_mod
    from specdeploy.exporter.export import staging
    from specdeploy.runtime.errors import BundleError

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_mod, "export_graph", full)
    out = tmp_path / "fresh"
    with pytest.raises(BundleError, match=r"ran out of space while writing '.*fresh' \(\d+\.\d GiB free"):
        export_mod.export_base(str(tiny_model_factory("llama")), out)
    assert list(tmp_path.iterdir()) == []
    before = sorted(p.name for p in tiny_bundle.iterdir())
    with pytest.raises(BundleError, match="ran out of space"), staging.updated_bundle(tiny_bundle):
        full()
    assert sorted(p.name for p in tiny_bundle.iterdir()) == before
    assert not [p for p in tiny_bundle.parent.iterdir() if ".tmp-" in p.name]
    # any other OSError keeps its own message
    with pytest.raises(OSError, match="other"), staging.staged_bundle(tmp_path / "x", force=False):
        raise OSError(errno.EIO, "other")


def test_prompt_errors(tiny_bundle):
    with load(tiny_bundle, draft=None) as engine:
        with pytest.raises(PromptError, match="empty"):
            engine.generate("   ")
        with pytest.raises(PromptError, match="maximum context"):
            engine.generate("word " * 2000)


def test_cli_generate_validate_and_errors(tiny_bundle, tiny_model_factory, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["generate", str(tiny_bundle), "--prompt", "Hello", "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output
    assert "tok/s" in res.output
    res = runner.invoke(main, ["generate", str(tiny_bundle), "--prompt", "Hello", "--chat", "--max-new-tokens", "4",
                               "--draft", "prompt-lookup"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["validate", str(tiny_bundle), "--model", str(tiny_model_factory("llama"))])
    assert res.exit_code == 0 and res.output.strip().endswith("PASSED"), res.output
    for args, msg in [
        (["export", "base", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "does not exist"),
        (["export", "base", "--out", str(tiny_bundle)], "--force"),
        (["generate", str(tmp_path / "nope"), "--prompt", "x"], "No bundle directory"),
        (["generate", str(tiny_bundle), "--prompt", "x", "--draft", "magic"], "Unknown draft"),
        (["generate", str(tiny_bundle), "--prompt", "x", "--tree", "[[3,1]]", "--draft", "prompt-lookup"], "Dangling"),
        (["generate", str(tiny_bundle), "--prompt", "x", "--backend", "ort-cuda"], "not available"),
        (["serve", str(tiny_bundle), "--port", "99999"], "99999 is not in the range 1<=x<=65535"),
        (["generate", str(tiny_bundle), "--prompt", "x", "--draft", "hybrid:magic"], "the hybrid's model must be"),
    ]:
        res = runner.invoke(main, args)
        assert res.exit_code != 0
        assert msg in res.output, (args, res.output)
        assert "Traceback" not in res.output


def test_runtime_is_lean(tiny_bundle):
    """`import specdeploy.runtime` and `specdeploy generate` pull in neither torch nor transformers."""
    code = f"""
import sys
import specdeploy.runtime
from specdeploy.exporter.cli import main
try:
    main(["generate", {str(tiny_bundle)!r}, "--prompt", "Hi", "--max-new-tokens", "4", "--draft", "prompt-lookup"],
         standalone_mode=False)
finally:
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "onnx", "onnxscript"))
    print("HEAVY", heavy)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "SPECDEPLOY_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


def test_import_directions():
    """runtime/ imports nothing from graphs/ or exporter/; graphs/ imports neither of the others."""
    import ast

    root = Path(__file__).resolve().parents[2]
    rules = {"runtime": ("specdeploy.graphs", "specdeploy.exporter", "torch", "transformers"),
             "graphs": ("specdeploy.runtime", "specdeploy.exporter")}
    bad = []
    for folder, banned in rules.items():
        for path in (root / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                bad += [f"{path.relative_to(root)}: {n}" for n in names if n.startswith(banned)]
    assert not bad, bad


def test_stream_decoder_matches_full_decode(tiny_bundle):
    from specdeploy.runtime.text import TextCodec

    codec = TextCodec(tiny_bundle, read_manifest(tiny_bundle).tokenizer)
    text = "Héllo wörld! 日本語のテキスト 🤖🚀 emoji\n  indented:\n\tdef f(x): return x**2  "
    ids = codec.encode(text)
    stream = codec.stream()
    deltas = [stream.push([t]) for t in ids]
    assert "".join(deltas) == codec.decode(ids) == stream.text
    assert all("\ufffd" not in d for d in deltas)


def test_readme_shows_the_tested_api_example():
    root = Path(__file__).resolve().parents[2]
    assert (root / "tests" / "api_example.py").read_text() in (root / "README.md").read_text()
