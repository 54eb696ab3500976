"""What the GPU check's runs share (``gpu.py``, ``gpu_real.py``, ``exporter/train/ondevice.py``): the staged JSON
report, one timed greedy decode on a step plan, and the lossless rule that turns a difference into a failure."""

from __future__ import annotations

import contextlib
import json
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from specdeploy.runtime.cost_curve import measure_cost_curve
from specdeploy.runtime.decode import Decoder, DecodeStats, GenerationConfig
from specdeploy.runtime.plan import StepPlan

SCHEMA = 1


def sig4(x: float) -> float:
    return float(f"{x:.4g}")  # four significant digits


class Report:
    """The JSON written after every stage; a stage's exception is recorded with its traceback and the next
    stage goes on, unless it builds on the failed one (:meth:`ready`). :attr:`failed` decides the exit code."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path = path
        self.data: dict[str, Any] = {"schema": SCHEMA, **meta, "stages": {}, "errors": {}}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=float))
        tmp.replace(self.path)

    def ready(self, name: str, needs: tuple[str, ...]) -> bool:
        """Whether the stages ``name`` builds on all passed; if not, ``name`` is recorded as skipped, with why."""
        missing = [n for n in needs if self.data["stages"].get(n, {}).get("status") != "ok"]
        if missing:
            self.data["stages"][name] = {"status": "skipped", "seconds": 0.0}
            self.data["errors"][name] = f"skipped: the {', '.join(missing)} stage did not pass"
            self.save()
            print(f"[gpu-check] {name}: skipped ({', '.join(missing)} did not pass)", flush=True)
        return not missing

    @property
    def failed(self) -> list[str]:
        """The stages that did not pass (an error, or skipped because one they build on failed)."""
        return [n for n, st in self.data["stages"].items() if st["status"] != "ok"]

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        t0 = time.time()
        out: dict[str, Any] = {}
        self.data[name] = out
        try:
            yield out
            status = "ok"
        except Exception:  # noqa: BLE001 - a check records a failed stage and goes on to the next
            self.data["errors"][name] = traceback.format_exc()[-3000:]
            status = "error"
        self.data["stages"][name] = {"status": status, "seconds": round(time.time() - t0, 2)}
        self.save()
        print(f"[gpu-check] {name}: {status} ({time.time() - t0:.1f}s)", flush=True)


def timed_decode(manifest, backend, plan: StepPlan, drafter, ids: list[list[int]],
            max_new: int) -> dict[str, Any]:
    dec = Decoder(backend, manifest, drafter, plan=plan)
    backend.capture_all()  # in the plan's form: a gathered plan's steps are other graphs (none missing: no-op)
    if dec.drafter is not None and dec.drafter.needs_cost_curve:
        dec.track_costs(measure_cost_curve(dec))  # then re-estimated from the loop's steps, as on the CPU
    list(dec.generate(ids[0][:8], GenerationConfig(max_new_tokens=4)))  # warm-up
    toks, tps, taus = [], [], []
    for p in ids:
        st = DecodeStats()
        toks.append(list(dec.generate(p, GenerationConfig(max_new_tokens=max_new), st)))
        tps.append(st.decode_tokens_per_s)
        taus.append(st.mean_accepted)
    return {"tokens": toks, "tok_s": round(float(np.mean(tps)), 1), "tau": round(float(np.mean(taus)), 3),
            "plan": plan.reason, "speculative": plan.speculate,
            "profile": drafter.profile() if drafter is not None and hasattr(drafter, "profile") else {}}


def plan_verdicts(plan: StepPlan) -> dict[str, Any]:
    """Each probed candidate's verdict: chains and trees exact, the worst check, its plain step time."""
    return {r.candidate.name: {"chains_exact": r.chains_exact, "trees_exact": r.trees_exact,
                               "worst": [r.worst().what, r.worst().max_abs] if r.checks else None,
                               "plain_ms": round(r.plain_ms, 3)} for r in plan.probes}


def outputs_equal(a: list[list[int]], b: list[list[int]]) -> list[bool]:
    return [x == y for x, y in zip(a, b, strict=True)]


def require_lossless(entry: dict[str, Any], plan: StepPlan, same: list[bool], what: str) -> None:
    """On an exact plan every output must equal plain decoding's: a difference fails the stage."""
    entry["lossy"] = plan.lossy
    if plan.exact and not all(same):
        raise AssertionError(f"{what} on the exact plan left plain decoding on {same.count(False)} of {len(same)} "
                             f"prompts: the probe passed a plan that is not exact here")


def lossless_problems(entry: dict[str, Any], plan: StepPlan, same: list[bool], what: str) -> list[str]:
    """:func:`require_lossless`'s verdict as messages (none where it holds), for a stage that measures several
    runs, records each, and fails once at the end."""
    try:
        require_lossless(entry, plan, same, what)
    except AssertionError as exc:
        return [str(exc)]
    return []
