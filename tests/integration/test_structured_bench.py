"""`specdeploy bench` on the real model with a structured prompt set: speculative output under a JSON schema equals
plain constrained output, and every answer parses (the sets themselves: tests/exporter/test_structured_sets.py)."""

from __future__ import annotations

from specdeploy.exporter.bench import run as bench_mod
from specdeploy.exporter.bench.run import run_bench


def test_constrained_bench_on_the_real_model_keeps_ar_output_and_valid_json(real_bundle, tmp_path, monkeypatch):
    # the quality classes (an fp32 torch reference, teacher-forced) are not what this checks, and cost the most here
    monkeypatch.setattr(bench_mod, "measure_quality", lambda running, *a: {s.name: "not measured" for s in running})
    report = run_bench(real_bundle, ["ar", "prompt-lookup"], None, 2, 32, 2, None, tmp_path / "bench.json",
                       progress=lambda m: None, prompt_set="json-template")
    by = {v["name"]: v for v in report["variants"]}
    assert list(by) == ["ar", "prompt-lookup", "ar-unconstrained"]
    assert by["prompt-lookup"]["identical_to_ar"] is True, by["prompt-lookup"]["note"]
    for name in ("ar", "prompt-lookup"):
        assert by[name]["valid_prompts"] == by[name]["constrained_prompts"] == 2, \
            [(p["finish_reason"], p["invalid_reason"]) for p in by[name]["prompts"]]
        assert all(p["finish_reason"] == "stop" for p in by[name]["prompts"])
    assert by["ar-unconstrained"]["constrained_prompts"] == 2  # its answers are checked too, and may not parse
