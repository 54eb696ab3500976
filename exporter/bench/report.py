"""``specdeploy bench`` results: per-variant aggregation, JSON, Markdown table and PNG plots.

Conventions (Spec-Bench): a variant's ``tokens_per_s`` is the mean over prompts of each prompt's
end-to-end tokens/s (prefill included); ``decode_tokens_per_s`` leaves out the first forward pass;
``speedup_vs_ar`` is the ratio of ``tokens_per_s`` to the ``ar`` variant's (end to end), ``decode_speedup_vs_ar``
that of ``decode_tokens_per_s`` (the decode loop alone); ``mean_accepted_tokens``
(tau) is the mean number of tokens emitted per decode step, pooled over all prompts.

JSON schema (stable; CI and other tools read it)::

    created: ISO-8601 UTC time
    config: bundle, model (source path), num_prompts, max_new_tokens, threads, tree, prompts_file,
            baseline ("ar"), baseline_added (ar was not asked for but ran as the baseline),
            machine {cpu_count, usable_cpus, cpu_model, cpu_isa, platform, python}, versions {package: version|null}
    variants: [ in run order, skipped ones included
      name, description, skipped, note (why skipped, or how outputs differ from ar; else null),
      tokens_per_s, decode_tokens_per_s, speedup_vs_ar (end to end), decode_speedup_vs_ar, mean_accepted_tokens (tau),
      identical_to_ar (every prompt's ids equal ar's), identical_prompts (how many),
      loop_overhead (fraction of decode time outside backend.step; ours only, else null),
      acceptance_histogram {"<tokens per step>": steps},
      depth_acceptance [per draft depth d = 1, 2, ...: fraction of steps that accepted the depth-d token],
      gate_decisions {draft, ar}: decode steps the drafter's gate sent to draft + verify and to a plain
                     1-token step (ours with a drafter; null otherwise),
      profile {cost_curve {rows: cost relative to a 1-row step, as measured at load; null when not
               measured}, cost_curve_loop {the same as last re-estimated from the decode loop's step
               times; null until it was}, draft_call_ms, step_ms (a step without its draft calls), and
               the drafter's own counts: gate {draft, explore, plain}, steps_by_source} (ours only; the
               last run's),
      quality {top1_agreement, perplexity, perplexity_fp32, perplexity_ratio, positions}: the variant's
              quality class, teacher-forced against fp32 torch on held-in text (null: not measured;
              quality_note says why),
      own_plain, identical_to_own_plain: a peer's speculative variant, the name of that peer's plain
              variant and on how many prompts its output equals that one's (null otherwise),
      categories {<prompt category>: {prompts, tokens_per_s, speedup_vs_ar (against ar on the same
              prompts, end to end), decode_speedup_vs_ar, identical_prompts, valid_prompts (constrained
              prompts whose answer meets the constraint; null without constraints), cut_prompts (of the
              others, those cut by --max-new-tokens before the answer ended)}},
      valid_prompts, constrained_prompts: of the prompts that carry a constraint (a structured prompt set),
              how many answers meet it (JSON valid against the schema, or tool calls of a known tool with valid
              arguments), and how many there are (0: none),
      steps, new_tokens, seconds,
      prompts: [ index, prompt_tokens, new_tokens, seconds, tokens_per_s, decode_tokens_per_s, tau,
                 steps, loop_overhead, finish_reason, identical_to_ar, first_difference (index of the
                 first token that differs from ar, else null), token_ids, valid (the answer meets the
                 prompt's constraint; null: none), invalid_reason, tool_calls (the runtime's parsed calls),
                 category, prompt and text (the first 3 prompts only) ] ]
Values a variant cannot measure are null (skipped variants: all of them). A run on constrained prompts also
runs ``ar-unconstrained`` (ar on the same ids without the constraint), beside ar in ``structured`` below the table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections import Counter
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from specdeploy.exporter.bench.best_source import against_best_table, auto_vs_best_source
from specdeploy.exporter.bench.plots import fmt as _fmt
from specdeploy.exporter.bench.plots import plot_acceptance, plot_speed
from specdeploy.exporter.bench.spec import BASELINE, RunResult, Score, StructuredPrompt, VariantSpec
from specdeploy.exporter.bench.structured import check_answer

_VERSIONED = ("specdeploy", "onnxruntime", "onnxruntime-gpu", "numpy", "tokenizers", "torch", "transformers",
              "onnxruntime-genai", "llama-cpp-python", "nvidia-mtbench-evaluator")


class _Prompt(Protocol):
    text: str
    ids: list[int]
    category: str
    structured: StructuredPrompt | None


class _Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


# --- aggregation -----------------------------------------------------------------------------
def acceptance_histogram(accepted: list[int]) -> dict[str, int]:
    """Counts of decode steps by tokens emitted in the step, keyed "1", "2", ... (JSON object keys)."""
    return {str(k): v for k, v in sorted(Counter(accepted).items())}


def depth_acceptance(accepted: list[int]) -> list[float]:
    """Per draft depth d = 1, 2, ...: the fraction of decode steps that accepted the depth-d draft token.

    A step that emits n tokens accepted draft depths 1..n-1 (the last token is the base's bonus), so
    this is ``P(n > d)``; for a heads draft it is each head's acceptance rate along the accepted path.
    """
    if not accepted:
        return []
    top = max(accepted)
    return [round(sum(a > d for a in accepted) / len(accepted), 4) for d in range(1, top)]


def quality_class(reference: list[Score], got: list[Score]) -> dict[str, Any]:
    """Top-1 agreement with the fp32 reference and perplexity (and its ratio to fp32's), pooled over texts."""
    agree = sum(a == b for r, g in zip(reference, got) for a, b in zip(r.argmax, g.argmax))
    positions = sum(len(r.argmax) for r in reference)
    ppl_ref = math.exp(sum(sum(r.nll) for r in reference) / sum(len(r.nll) for r in reference))
    ppl = math.exp(sum(sum(g.nll) for g in got) / sum(len(g.nll) for g in got))
    return {"top1_agreement": agree / positions, "perplexity": ppl, "perplexity_fp32": ppl_ref,
            "perplexity_ratio": ppl / ppl_ref, "positions": positions}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None when identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _prompt_entry(i: int, r: RunResult, base: RunResult, prompt: _Prompt, codec: _Decoder,
                  with_text: bool) -> dict[str, Any]:
    n = len(r.tokens)
    n_decode = n - r.first_tokens
    entry: dict[str, Any] = {
        "index": i,
        "prompt_tokens": len(prompt.ids),
        "new_tokens": n,
        "seconds": r.seconds,
        "tokens_per_s": n / r.seconds if r.seconds > 0 else 0.0,
        "decode_tokens_per_s": n_decode / r.decode_seconds if r.decode_seconds > 0 and n_decode > 0 else None,
        "tau": _mean(r.accepted) if r.accepted else None,
        "steps": len(r.accepted) if r.accepted is not None else None,
        "loop_overhead": (1.0 - r.backend_seconds / r.decode_seconds
                          if r.backend_seconds is not None and r.decode_seconds > 0 else None),
        "finish_reason": r.finish_reason or None,
        # every repeat of both gave these tokens (a run whose repeats disagree is not deterministic: not identical)
        "identical_to_ar": r.tokens == base.tokens and r.repeats_agree and base.repeats_agree,
        "first_difference": _first_difference(r.tokens, base.tokens),
        "token_ids": r.tokens,
        "category": prompt.category,
        "valid": None,
        "invalid_reason": None,
        "tool_calls": r.tool_calls,
        "repeat_seconds": r.repeat_seconds,
    }
    structured = getattr(prompt, "structured", None)
    if structured is not None:
        why = check_answer(structured.constraint, codec.decode(r.tokens), r.tool_calls)
        entry["valid"], entry["invalid_reason"] = why is None, why
    if with_text:
        entry["prompt"] = prompt.text
        entry["text"] = codec.decode(r.tokens)
    return entry


def _variant_entry(spec: VariantSpec, runs: list[RunResult], base: list[RunResult], prompts: list[_Prompt],
                   codec: _Decoder, text_prompts: int) -> dict[str, Any]:
    per = [_prompt_entry(i, r, b, p, codec, i < text_prompts)
           for i, (r, b, p) in enumerate(zip(runs, base, prompts))]
    accepted = [a for r in runs if r.accepted is not None for a in r.accepted]
    have_steps = all(r.accepted is not None for r in runs)
    ours = all(r.backend_seconds is not None for r in runs)
    decode_s = sum(r.decode_seconds for r in runs)
    same = sum(p["identical_to_ar"] for p in per)
    note = None
    lossy = any(r.lossy for r in runs)
    if same < len(per):
        asked = dict(spec.options).get("step_plan")
        why = ("another runtime or precision, whose kernels can flip near-tied argmaxes" if spec.runner != "ours"
               else "decoded without the prompts' constraint, which ar decodes under" if dict(spec.options).get(
                   "unconstrained")
               else "LOSSY: inexact speculation was allowed" if lossy
               else f"step plan '{asked}', another graph's arithmetic than ar's: its own plain decoding is its "
                    f"reference" if asked
               else "greedy speculative decoding must match it exactly, so this is a bug")
        note = f"differs from ar on {len(per) - same}/{len(per)} prompts ({why})"
    if unsteady := sum(not r.repeats_agree for r in runs):
        note = f"its repeats gave different tokens on {unsteady}/{len(runs)} prompts" + (f"; {note}" if note else "")
    if any(r.refused for r in runs):
        note = f"draft refused, ran plain: {runs[0].plan}" + (f"; {note}" if note else "")
    elif lossy and note is None:
        note = "LOSSY: inexact speculation was allowed (identical on these prompts)"
    return {
        "name": spec.name,
        "description": spec.description,
        "skipped": False,
        "note": note,
        "lossy": lossy,
        "plan": runs[0].plan if runs else None,
        "tokens_per_s": _mean([p["tokens_per_s"] for p in per]),
        "decode_tokens_per_s": _mean([p["decode_tokens_per_s"] for p in per if p["decode_tokens_per_s"]]),
        "speedup_vs_ar": None,  # filled once the baseline is known
        "decode_speedup_vs_ar": None,
        "mean_accepted_tokens": _mean(accepted) if have_steps and accepted else None,
        "identical_to_ar": same == len(per),
        "identical_prompts": same,
        "loop_overhead": (1.0 - sum(r.backend_seconds or 0.0 for r in runs) / decode_s
                          if ours and decode_s > 0 else None),
        "acceptance_histogram": acceptance_histogram(accepted) if have_steps else None,
        "depth_acceptance": depth_acceptance(accepted) if have_steps else None,
        "gate_decisions": ({"draft": sum(r.gate_parallel for r in runs), "ar": sum(r.gate_ar for r in runs)}
                           if all(r.gate_parallel is not None and r.gate_ar is not None for r in runs) else None),
        "profile": runs[-1].profile if runs else None,
        "steps": len(accepted) if have_steps else None,
        "new_tokens": sum(len(r.tokens) for r in runs),
        "seconds": sum(r.seconds for r in runs),
        "valid_prompts": sum(bool(p["valid"]) for p in per),
        "constrained_prompts": sum(p["valid"] is not None for p in per),
        "prompts": per,
    }


def _categories(v: dict[str, Any], ar: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per prompt category: tokens/s (mean over its prompts), the speed-up against ``ar`` on the same
    prompts, and how many prompts equal ``ar``'s output."""
    out: dict[str, dict[str, Any]] = {}
    for cat in dict.fromkeys(p["category"] for p in v["prompts"]):
        idx = [i for i, p in enumerate(v["prompts"]) if p["category"] == cat]
        ratios = {}
        for key, ratio in (("tokens_per_s", "speedup_vs_ar"), ("decode_tokens_per_s", "decode_speedup_vs_ar")):
            mine = _mean([v["prompts"][i][key] for i in idx if v["prompts"][i][key]])
            base = _mean([ar["prompts"][i][key] for i in idx if ar["prompts"][i][key]]) if ar and ar["prompts"] else None
            ratios[ratio] = mine / base if mine is not None and base else None
        checked = [v["prompts"][i]["valid"] for i in idx if v["prompts"][i]["valid"] is not None]
        out[cat] = {"prompts": len(idx), "tokens_per_s": _mean([v["prompts"][i]["tokens_per_s"] for i in idx]),
                    **ratios, "identical_prompts": sum(v["prompts"][i]["identical_to_ar"] for i in idx),
                    "valid_prompts": sum(checked) if checked else None,
                    "cut_prompts": sum(v["prompts"][i]["valid"] is False and v["prompts"][i]["finish_reason"] == "length"
                                       for i in idx) if checked else None}
    return out


def _skipped_entry(spec: VariantSpec, note: str) -> dict[str, Any]:
    return {"name": spec.name, "description": spec.description, "skipped": True, "note": note, "lossy": False,
            "plan": None,
            "tokens_per_s": None, "decode_tokens_per_s": None, "speedup_vs_ar": None, "decode_speedup_vs_ar": None,
            "mean_accepted_tokens": None, "identical_to_ar": None, "identical_prompts": None,
            "loop_overhead": None, "acceptance_histogram": None, "depth_acceptance": None,
            "gate_decisions": None, "profile": None, "steps": None,
            "new_tokens": None, "categories": {}, "quality": None, "valid_prompts": None, "constrained_prompts": None, "quality_note": None, "own_plain": None, "identical_to_own_plain": None,
            "seconds": None, "prompts": []}


def machine_info() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    from specdeploy.runtime.machine import cpu_isa, cpu_name

    return {"cpu_count": os.cpu_count(), "usable_cpus": usable, "cpu_model": cpu_name(),
            "cpu_isa": cpu_isa(), "platform": platform.platform(), "python": sys.version.split()[0]}


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def build_report(specs: list[VariantSpec], skipped: dict[str, str], results: dict[str, list[RunResult]],
                 prompts: list[_Prompt], codec: _Decoder, config: dict[str, Any],
                 text_prompts: int = 3, machine: dict[str, str] | None = None,
                 quality: dict[str, dict | str] | None = None) -> dict[str, Any]:
    """The bench JSON document: ``variants`` (in run order), ``config`` and ``created``.

    ``quality``: per variant its quality class (:func:`quality_class`) or why it has none.

    ``machine``: what replaces this CPU's model and ISA in ``config.machine`` (an emulated CPU's)."""
    base = results.get(BASELINE)
    variants = []
    for spec in specs:
        if spec.name in skipped:
            variants.append(_skipped_entry(spec, skipped[spec.name]))
            continue
        entry = _variant_entry(spec, results[spec.name], base or [], prompts, codec, text_prompts)
        q = (quality or {}).get(spec.name)
        entry["quality"] = q if isinstance(q, dict) else None
        entry["quality_note"] = q if isinstance(q, str) else None
        own = results.get(spec.plain) if spec.plain else None
        entry["own_plain"] = spec.plain if own else None
        entry["identical_to_own_plain"] = (sum(r.tokens == o.tokens for r, o in zip(results[spec.name], own))
                                           if own else None)
        if own and spec.runner == "ours" and not entry["lossy"] and entry["identical_to_own_plain"] < len(own):
            entry["note"] = (f"differs from {spec.plain} on {len(own) - entry['identical_to_own_plain']}/{len(own)} "
                             f"prompts (greedy speculative decoding must match it exactly, so this is a bug)")
        variants.append(entry)
    ar_entry = next((v for v in variants if v["name"] == BASELINE and not v["skipped"]), None)
    for v in variants:
        for key, ratio in (("tokens_per_s", "speedup_vs_ar"), ("decode_tokens_per_s", "decode_speedup_vs_ar")):
            base = ar_entry[key] if ar_entry else None
            if base and v[key] is not None:
                v[ratio] = v[key] / base
    for v in variants:
        v["categories"] = _categories(v, ar_entry)
    config = {**config, "machine": {**machine_info(), **(machine or {})}, "versions": package_versions()}
    out = {"variants": variants, "config": config, "created": datetime.now(UTC).isoformat(timespec="seconds")}
    if against := auto_vs_best_source(specs, variants):
        out["auto_vs_best_source"] = against
    return out


# --- outputs ---------------------------------------------------------------------------------
def _subject(c: dict[str, Any]) -> str:
    """The model and, where the report has it, the bundle's base-graph precisions ("fp32/gguf-q4_1")."""
    name = Path(c["model"]).name
    return f"{name} [{c['precision']}]" if c.get("precision") else name


def _emulated(c: dict[str, Any]) -> str:
    from specdeploy.exporter.bench.emulate import emulation_note

    return emulation_note(c["emulated_cpu"])


def _baseline_plan(report: dict[str, Any]) -> str | None:
    return next((v.get("plan") for v in report["variants"] if v["name"] == BASELINE and not v["skipped"]), None)


def markdown_table(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        (f"specdeploy bench: {_subject(c)}, {c['num_prompts']} prompts x {c['max_new_tokens']} new "
         f"tokens, {c['threads']} threads, tree {c['tree'] or 'auto'} ({c['machine']['cpu_model']}; "
         f"{c['machine'].get('cpu_isa', '?')})"),
        *(["", f"**{_emulated(c)}**"] if c.get("emulated_cpu") else []),
        *(["", f"Step plan ({BASELINE}): {plan}"] if (plan := _baseline_plan(report)) else []),
        *(["", (f"Each prompt ran {n} times per variant, each time in a worker of its own that saw the same requests "
                f"before it, interleaved; a prompt's figures are those of its median run.")]
          if (n := c.get("repeats", 1)) > 1 else []),
        *(["", (f"Quality class: top-1 agreement and perplexity ratio against fp32 torch (transformers), "
                f"teacher-forced on {q['positions']} positions of held-in text; perplexity fp32 "
                f"{q['perplexity_fp32']:.2f}.")] if (q := _any_quality(report)) else []),
        "",
        ("| variant | tok/s | decode tok/s | speed-up vs ar (end to end) | decode speed-up | τ | accepted at depth 1, 2, "
         "... | gate: draft / AR | identical to ar | same as own plain | quality: top-1 / ppl× | loop overhead | note |"),
        "|---|---:|---:|---:|---:|---:|---|---:|:---:|:---:|:---:|---:|---|",
    ]
    for v in report["variants"]:
        if v["skipped"]:
            ident = "–"
        elif v["identical_to_ar"]:
            ident = "yes"
        else:
            ident = f"no ({v['identical_prompts']}/{len(v['prompts'])} same)"
        overhead = None if v["loop_overhead"] is None else 100 * v["loop_overhead"]
        depths = " ".join(f"{x:.2f}" for x in (v.get("depth_acceptance") or [])[:6]) or "–"
        gate = v.get("gate_decisions")
        gate_cell = f"{gate['draft']} / {gate['ar']}" if gate else "–"
        lines.append(
            f"| {v['name']}{' [LOSSY]' if v.get('lossy') else ''} | {_fmt(v['tokens_per_s'], '.1f')} | {_fmt(v['decode_tokens_per_s'], '.1f')} | "
            f"{_fmt(v['speedup_vs_ar'], '.2f', '×')} | {_fmt(v['decode_speedup_vs_ar'], '.2f', '×')} | "
            f"{_fmt(v['mean_accepted_tokens'], '.2f')} | {depths} | "
            f"{gate_cell} | {ident} | {_own_plain_cell(v)} | {_quality_cell(v)} | "
            f"{_fmt(overhead, '.0f', '%')} | {(v['note'] or '').replace('|', '/')} |"
        )
    return "\n".join(lines + _category_table(report) + against_best_table(report) + _structured_table(report)) + "\n"


def _category_table(report: dict[str, Any]) -> list[str]:
    """Speed-ups by prompt category, one row per variant that ran (none when there is one category)."""
    ran = [v for v in report["variants"] if not v["skipped"]]
    cats = list(dict.fromkeys(c for v in ran for c in v.get("categories") or {}))
    if len(cats) < 2:
        return []
    sizes = {c: next(v["categories"][c]["prompts"] for v in ran if c in v["categories"]) for c in cats}
    lines = ["", ("Speed-up vs ar by prompt category, end to end (prefill included), then the decode loop's alone in "
                  "brackets (prompts per category in the header; a cell says where outputs differ from ar):"), "",
             "| variant | all | " + " | ".join(f"{c} ({sizes[c]})" for c in cats) + " |",
             "|---|---:|" + "---:|" * len(cats)]
    for v in ran:
        cells = []
        for c in cats:
            e = v["categories"].get(c)
            same = "" if not e or e["identical_prompts"] == e["prompts"] else f" ({e['identical_prompts']}/{e['prompts']} same)"
            decode = f" [{_fmt(e.get('decode_speedup_vs_ar'), '.2f', '×')}]" if e else ""
            cells.append(_fmt(e["speedup_vs_ar"] if e else None, ".2f", "×") + decode + same)
        lines.append(f"| {v['name']} | {_fmt(v['speedup_vs_ar'], '.2f', '×')} "
                     f"[{_fmt(v.get('decode_speedup_vs_ar'), '.2f', '×')}] | " + " | ".join(cells) + " |")
    return lines


def _structured_table(report: dict[str, Any]) -> list[str]:
    """Per category of constrained prompts: each variant's tok/s, its speed-up against constrained ar, how many
    answers meet the constraint and equal ar's; then constrained ar against ar without the constraint."""
    ran = [v for v in report["variants"] if not v["skipped"] and v.get("constrained_prompts")]
    cats = list(dict.fromkeys(c for v in ran for c, e in (v.get("categories") or {}).items()
                              if e.get("valid_prompts") is not None))
    if not cats:
        return []
    lines = ["", ("Structured output by category: tok/s end to end (speed-up vs constrained ar, end to end [the decode loop's]), answers that meet "
                  "the constraint (JSON valid against its schema; a call of a known tool with valid arguments; 'cut': "
                  "stopped by --max-new-tokens first), answers identical to ar's:"), "",
             "| variant | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    for v in ran:
        cells = []
        for c in cats:
            e = (v.get("categories") or {}).get(c)
            cells.append("–" if not e else f"{_fmt(e['tokens_per_s'], '.1f')} ({_fmt(e['speedup_vs_ar'], '.2f', '×')}"
                         f" [{_fmt(e.get('decode_speedup_vs_ar'), '.2f', '×')}]), "
                         f"valid {e['valid_prompts']}/{e['prompts']}{f' ({cut} cut)' if (cut := e.get('cut_prompts')) else ''}, "
                         f"same {e['identical_prompts']}/{e['prompts']}")
        lines.append(f"| {v['name']} | " + " | ".join(cells) + " |")
    free = next((v for v in ran if v["name"] == "ar-unconstrained"), None)
    if free is not None:
        # The decode loop's tok/s: the mask is a cost of each step, while the constrained answers end sooner, so
        # their end-to-end tok/s spreads the same prefill over fewer tokens.
        ratios = [f"{c} {_fmt(r, '.2f', '×')}" for c in cats if c in free["categories"]
                  for r in [_inverse(free["categories"][c].get("decode_speedup_vs_ar"))]]
        lines += ["", "Constrained ar against ar without the constraint (the decode loop's tok/s ratio, same prompts; "
                      "end to end, the shorter constrained answers spread the same prefill over fewer tokens): "
                  + ", ".join(ratios)]
    return lines


def _inverse(x: float | None) -> float | None:
    return 1.0 / x if x else None


def _any_quality(report: dict[str, Any]) -> dict[str, Any] | None:
    return next((v["quality"] for v in report["variants"] if v.get("quality")), None)


def _own_plain_cell(v: dict[str, Any]) -> str:
    if v.get("identical_to_own_plain") is None:
        return "–"
    return f"{v['identical_to_own_plain']}/{len(v['prompts'])} ({v['own_plain']})"


def _quality_cell(v: dict[str, Any]) -> str:
    q = v.get("quality")
    return "–" if not q else f"{q['top1_agreement']:.3f} / {q['perplexity_ratio']:.3f}"


def write_outputs(report: dict[str, Any], json_out: Path) -> str:
    """Write ``json_out``, ``<stem>.md``, ``<stem>.png`` and ``<stem>_acceptance.png``; returns the table."""
    import matplotlib

    matplotlib.use("Agg")
    json_out.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_out.with_name(json_out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, json_out)
    table = markdown_table(report)
    json_out.with_suffix(".md").write_text(table)
    plot_speed(report, json_out.with_suffix(".png"), _subject(report["config"]))
    plot_acceptance(report, json_out.with_name(json_out.stem + "_acceptance.png"))
    return table
