"""``auto`` against the fastest single draft source that ran beside it in one ``specdeploy bench`` run, by
prompt category: what ``auto`` loses, if anything, by choosing among its sources each step."""

from __future__ import annotations

from typing import Any

from specdeploy.exporter.bench.plots import fmt
from specdeploy.exporter.bench.spec import VariantSpec
from specdeploy.runtime.drafters.kinds import AUTO, HYBRID, bench_variant

ALL_PROMPTS = "all prompts"  # auto_vs_best_source's key for the whole run


def auto_vs_best_source(specs: list[VariantSpec], variants: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per category (:data:`ALL_PROMPTS` first), ``auto``'s speed against the fastest single draft source beside it (our
    exact drafts on the default plan: prompt lookup, n-grams, suffix, a trained draft), end to end and in the decode
    loop, each with the source it was measured against; empty where ``auto`` or every single source is missing.
    (The fastest of several sources is a maximum of noisy figures: it reads high by about their noise.)"""
    by_name = {v["name"]: v for v in variants if not v["skipped"] and not v["lossy"]}
    single = [by_name[s.name] for s in specs if s.name in by_name and s.runner == "ours" and s.draft
              and not s.draft.startswith((AUTO, HYBRID)) and not s.options and not s.plain]
    auto = by_name.get(bench_variant(AUTO))
    if auto is None or not single:
        return {}

    def speed(v: dict[str, Any], cat: str, key: str) -> float | None:
        return v[key] if cat == ALL_PROMPTS else (v.get("categories") or {}).get(cat, {}).get(key)

    out: dict[str, dict[str, Any]] = {}
    cats = list(auto.get("categories") or {})
    for cat in [ALL_PROMPTS, *(cats if len(cats) > 1 else [])]:
        row: dict[str, Any] = {}
        for key, label in (("speedup_vs_ar", ""), ("decode_speedup_vs_ar", "decode_")):
            scored = [(x, v["name"]) for v in single if (x := speed(v, cat, key))]
            mine = speed(auto, cat, key)
            best = max(scored) if scored else None
            row[f"{label}best"] = best[1] if best else None
            row[f"{label}ratio"] = mine / best[0] if best and mine else None
        out[cat] = row
    return out


def against_best_table(report: dict[str, Any]) -> list[str]:
    """auto against the fastest single draft source, by category (none when auto or every source is missing)."""
    rows = report.get("auto_vs_best_source")
    if not rows:
        return []
    lines = ["", ("auto's speed over the fastest single draft source's beside it, by category: end to end, then the "
                  "decode loop's in brackets, each with that source:"), "",
             "| category | auto ÷ best, end to end | auto ÷ best, decode loop |", "|---|---:|---:|"]
    for cat, r in rows.items():
        lines.append(f"| {cat} | {fmt(r['ratio'], '.3f')} ({r['best'] or '–'}) | "
                     f"{fmt(r['decode_ratio'], '.3f')} ({r['decode_best'] or '–'}) |")
    return lines
