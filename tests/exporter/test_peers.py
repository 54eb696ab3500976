"""Bench peers: onnxruntime-genai (fp32/int4) and llama.cpp, skipped with a note when they cannot run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from specdeploy.exporter.bench import spec as bench_spec
from specdeploy.exporter.bench.peers import PEERS_INSTALL, LlamaCppRunner, genai_model_dir
from specdeploy.exporter.bench.registry import RUNNERS, VARIANTS, unavailable
from specdeploy.exporter.cli import main
from specdeploy.runtime.bundle import read_manifest

PEERS = ("ort-genai-fp32", "ort-genai-int4", "llama.cpp")
HAS_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None


@pytest.fixture()
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Repeat after me: red green blue, red green blue."}) + "\n"
                    + json.dumps({"prompt": "Write two sentences about cats."}) + "\n")
    return path


def _hide(monkeypatch, *modules: str) -> None:
    """Make ``modules`` look uninstalled to the bench's availability check."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name in modules else real(name, *args, **kwargs)

    monkeypatch.setattr(bench_spec.importlib.util, "find_spec", find_spec)


def test_peers_are_registered():
    for name in PEERS:
        spec = VARIANTS[name]
        assert spec.runner in RUNNERS and spec.install == PEERS_INSTALL
        assert "outputs may differ from ar" in spec.description


def test_missing_peer_packages_skip_with_a_note(monkeypatch, tiny_bundle):
    _hide(monkeypatch, "onnxruntime_genai", "llama_cpp")
    manifest = read_manifest(tiny_bundle)
    for name in PEERS:
        note = unavailable(VARIANTS[name], manifest)
        assert note is not None and note.startswith("skipped: needs the Python package(s)")
        assert PEERS_INSTALL in note


def test_llama_cpp_needs_a_gguf_source(monkeypatch, tiny_bundle):
    """The tiny bundle comes from a HF folder: llama.cpp is skipped even when its package is present."""
    real = importlib.util.find_spec
    monkeypatch.setattr(bench_spec.importlib.util, "find_spec",
                        lambda name, *a, **k: real("json") if name == "llama_cpp" else real(name, *a, **k))
    note = unavailable(VARIANTS["llama.cpp"], read_manifest(tiny_bundle))
    assert note is not None and "not a GGUF" in note
    assert LlamaCppRunner.unavailable(VARIANTS["llama.cpp"], read_manifest(tiny_bundle)) == note


def test_bench_with_missing_peers_runs_the_rest(monkeypatch, tmp_path, tiny_bundle, prompts_file):
    _hide(monkeypatch, "onnxruntime_genai", "llama_cpp")
    out = tmp_path / "bench.json"
    args = ["bench", str(tiny_bundle), "--variants", "ar,ort-genai-int4,ort-genai-fp32,llama.cpp", "--prompts",
            str(prompts_file), "--num-prompts", "2", "--max-new-tokens", "4", "--threads", "2", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    variants = {v["name"]: v for v in json.loads(out.read_text())["variants"]}
    assert variants["ar"]["skipped"] is False
    for name in PEERS:
        assert variants[name]["skipped"] is True and PEERS_INSTALL in variants[name]["note"]


@pytest.mark.skipif(not HAS_GENAI, reason="onnxruntime-genai is not installed (pip install 'specdeploy[peers]')")
def test_ort_genai_fp32_in_the_bench(monkeypatch, tmp_path, tiny_bundle, prompts_file):
    """The builder converts the tiny model offline into the specdeploy cache; the bench runs it beside ours."""
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "bench.json"
    args = ["bench", str(tiny_bundle), "--variants", "ar,ort-genai-fp32", "--prompts", str(prompts_file),
            "--num-prompts", "2", "--max-new-tokens", "8", "--threads", "2", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    ar, genai = json.loads(out.read_text())["variants"]
    assert ar["name"] == "ar" and ar["skipped"] is False
    assert genai["name"] == "ort-genai-fp32" and genai["skipped"] is False
    assert all(1 <= p["new_tokens"] <= 8 for p in genai["prompts"]) and genai["tokens_per_s"] > 0
    assert isinstance(genai["identical_to_ar"], bool)  # reported as measured, either way
    if not genai["identical_to_ar"]:
        assert "differs from ar" in genai["note"]
    print(f"tiny model, ort-genai fp32 identical to ar: {genai['identical_to_ar']}")
    model_dir = genai_model_dir(read_manifest(tiny_bundle), "fp32")
    assert str(model_dir).startswith(str(tmp_path / "cache"))
    assert (model_dir / "genai_config.json").is_file()  # built once, reused by later runs


def _gguf_manifest(tiny_bundle):
    """The tiny bundle's manifest, pretending it was exported from the embedded SmolLM2 GGUF."""
    from specdeploy.exporter.source import default_gguf_path
    from specdeploy.runtime.bundle import SourceInfo

    manifest = read_manifest(tiny_bundle)
    return manifest.replace(source=SourceInfo(str(default_gguf_path()), "gguf", "0" * 64))


def test_llama_cpp_that_crashes_here_is_skipped(monkeypatch, tiny_bundle):
    from specdeploy.exporter.bench import peers as bench_peers

    manifest = _gguf_manifest(tiny_bundle)
    monkeypatch.setattr(bench_peers, "llama_cpp_mode", lambda gguf: None)
    note = LlamaCppRunner.unavailable(VARIANTS["llama.cpp"], manifest)
    assert note is not None and "crashes" in note
    monkeypatch.setattr(bench_peers, "llama_cpp_mode", lambda gguf: "plain")
    assert LlamaCppRunner.unavailable(VARIANTS["llama.cpp"], manifest) is None


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (pip install 'specdeploy[peers]')")
def test_llama_cpp_runner_decodes_the_gguf(monkeypatch, tmp_path, tiny_bundle):
    from specdeploy.exporter.bench.peers import LLAMA_MODES

    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    manifest = _gguf_manifest(tiny_bundle)
    if LlamaCppRunner.unavailable(VARIANTS["llama.cpp"], manifest) is not None:
        pytest.skip("llama-cpp-python cannot decode on this machine")
    runner = LlamaCppRunner(tiny_bundle, manifest, VARIANTS["llama.cpp"], 2, None)
    try:
        assert runner.mode in LLAMA_MODES
        ids = runner.llm.tokenize(b"The capital of France is")
        first = runner.generate(ids, 6)
        again = runner.generate(ids, 6)  # no KV reuse between prompts changes nothing for greedy
    finally:
        runner.close()
    assert len(first.tokens) == 6 and first.tokens == again.tokens
    assert first.accepted == [1] * 5 and first.seconds > 0
