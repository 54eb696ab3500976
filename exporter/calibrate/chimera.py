"""Calibrate a Chimera draft's default tree on held-in prompts, by timing the real decode loop.

Chimera drafts autoregressively (one draft-layer call per depth), so the heads' top-k at depth d
depends on the argmax chain before it and cannot be replayed offline from base hidden states the way
:mod:`.calibrate_draft` does for Medusa/Cerberus. Instead every candidate tree runs the real loop on
ShareGPT first user turns (never the MT-bench questions), interleaved per prompt with plain decoding
so that machine load hits all variants alike; the tree with the most decode tokens/s becomes the
default. The result goes to ``<weights>.calibration.json`` (tied to the weights by their hash), and
the bundle's draft entry is re-exported with it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdeploy.exporter.train.weights import load_draft_weights
from specdeploy.runtime.bundle import hash_files
from specdeploy.runtime.drafters.kinds import CHIMERA

# The registered trees are 4 deep; shallower ones save one draft call per level they drop, which pays
# when the deeper heads are rarely accepted.
TREE8_DEPTH3 = "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]"
TREE7_DEPTH2 = "[[0],[1],[2],[0,0],[0,1],[1,0]]"
CHIMERA_TREES = ("chain4", "tree8", "tree16", "dynamic:16", "dynamic:32", TREE8_DEPTH3, TREE7_DEPTH2)
# Where the step plan verifies chains only, the drafter sizes each chain itself (runtime/drafters/depth.py),
# so there is one candidate: the adaptive chain over every head, timed for the record.
CHIMERA_CHAINS = ("chain4",)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def calibrate_chimera(bundle: str | Path, draft: str | Path, prompts: int = 6, max_new_tokens: int = 96,
                      threads: int = 2, trees: tuple[str, ...] | None = None,
                      progress: Callable[[str], None] = _stderr, source: str | None = None) -> dict[str, Any]:
    """Time each candidate tree against plain decoding; write the calibration and update the bundle.

    Where the step plan verifies chains only, the result is kept apart, under ``row_exact`` in the same
    file (the chains section), as a record: there the drafter sizes its chains itself, step by step.
    Returns this run's result (``default_tree``, ``sweep``, ``speedup``, ...).
    """
    from specdeploy.exporter.export.draft import calibration_path, export_draft, read_calibration
    from specdeploy.exporter.train.sharegpt import heldin_prompts
    from specdeploy.runtime import load
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.decode import DecodeStats, GenerationConfig
    from specdeploy.runtime.errors import DraftMismatchError

    bundle, draft = Path(bundle), Path(draft)
    weights = load_draft_weights(draft, CHIMERA)
    sha = hash_files([draft])
    manifest = read_manifest(bundle)
    current = next((d for d in manifest.drafts if d.kind == CHIMERA), None)
    if current is None or current.weights_sha != sha:
        progress("[1/3] adding these Chimera weights to the bundle ...")
        export_draft(bundle, CHIMERA, draft, progress=lambda m: None, use_calibration=False)
    t0 = time.time()
    plain = load(bundle, draft=None, threads=threads)
    # A step plan that verifies chains only (measured on this machine, runtime/plan.py) gets chain
    # candidates, and its result is kept apart under ``row_exact``: its costs and candidates differ.
    row_exact = not plain.plan.trees
    trees = trees or (CHIMERA_CHAINS if row_exact else CHIMERA_TREES)
    engines = {}
    try:
        ids_all = heldin_prompts(lambda m: plain.encode(messages=m), prompts, source=source)
        engines = {t: load(bundle, draft=CHIMERA, tree=t, threads=threads) for t in trees}
        names = ["ar", *trees]
        totals = {n: {"tokens": 0, "seconds": 0.0, "steps": 0, "identical": 0} for n in names}
        progress(f"[2/3] timing {', '.join(trees)} against plain decoding on {len(ids_all)} held-in prompts "
                 f"x {max_new_tokens} tokens ...")
        for i, ids in enumerate(ids_all):
            ref = None
            for n in names:
                eng = plain if n == "ar" else engines[n]
                st = DecodeStats()
                out = eng.generate_ids(ids, GenerationConfig(max_new_tokens), st)
                ref = out if ref is None else ref
                t = totals[n]
                t["tokens"] += st.new_tokens - 1
                t["seconds"] += st.decode_s
                t["steps"] += st.steps
                t["identical"] += int(out == ref)
            progress(f"  prompt {i + 1}/{len(ids_all)} done")
    finally:
        plain.close()
        for e in engines.values():
            e.close()
    sweep = {n: {"decode_tok_s": round(t["tokens"] / max(t["seconds"], 1e-9), 2),
                 "tau": round(t["tokens"] / max(t["steps"], 1), 3), "identical": f"{t['identical']}/{len(ids_all)}"}
             for n, t in totals.items()}
    best = max(trees, key=lambda n: sweep[n]["decode_tok_s"])
    if any(sweep[n]["identical"] != f"{len(ids_all)}/{len(ids_all)}" for n in trees):
        progress("warning: a Chimera run differed from plain greedy decoding; that is a bug, please report it.")
    result = {
        "default_tree": best,
        "sweep": sweep,
        "speedup": round(sweep[best]["decode_tok_s"] / max(sweep["ar"]["decode_tok_s"], 1e-9), 3),
        "prompts": len(ids_all),
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "seconds": round(time.time() - t0, 1),
    }
    path = calibration_path(draft)
    try:  # keep the other kind of bundle's result when the weights are the same
        old = read_calibration(path, weights) if path.is_file() else {}
    except DraftMismatchError:
        old = {}
    head = {"kind": CHIMERA, "weights_sha": sha, "base_weight_sha": weights.config.base_weight_sha}
    if row_exact:
        calib = {**(old or head), "row_exact": result}
    else:
        calib = {**head, **result, **({"row_exact": old["row_exact"]} if "row_exact" in old else {})}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(calib, indent=1))
    os.replace(tmp, path)
    progress(f"[3/3] default tree {best} ({sweep[best]['decode_tok_s']} vs {sweep['ar']['decode_tok_s']} tok/s plain); "
             f"wrote {path}")
    if result["speedup"] < 1.0:
        progress(f"note: no candidate beat plain decoding here ({result['speedup']}x at best); on this bundle and "
                 "machine, decoding without --draft chimera is faster.")
    export_draft(bundle, CHIMERA, draft, progress=lambda m: None)
    return result


def calibrate(bundle: str | Path, kind: str, draft: str | Path, prompts: int = 6, max_new_tokens: int = 96,
              threads: int = 2, progress: Callable[[str], None] = _stderr) -> dict[str, Any]:
    """The Chimera kind's calibrator, with the signature every ``DraftKind.calibrator`` has."""
    return calibrate_chimera(bundle, draft, prompts=prompts, max_new_tokens=max_new_tokens, threads=threads,
                             progress=progress)
