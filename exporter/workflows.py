"""Jobs that span rooms: train a draft, then calibrate it on a bundle (a temporary one if none is given)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdeploy.exporter.export.base import export_base
from specdeploy.exporter.export.draft import export_draft
from specdeploy.runtime.drafters.kinds import describe, resolve


def calibrate_with_bundle(kind: str, draft: Path, model: str | None, bundle: Path | None, prompts: int,
                          max_new_tokens: int, threads: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Calibrate against ``bundle`` (the draft is added to it), or a temporary base export."""
    scratch = None
    try:
        if bundle is None:
            scratch = Path(tempfile.mkdtemp(prefix="specdeploy-calib-"))
            bundle = scratch / "bundle"
            log("exporting a temporary base bundle for calibration ...")
            export_base(model, bundle, max_context=2048, progress=lambda m: None)
        export_draft(bundle, kind, draft, model=model, progress=lambda m: None, use_calibration=False)
        calibrate = resolve(describe(kind).calibrator)
        return calibrate(bundle, kind, draft, prompts=prompts, max_new_tokens=max_new_tokens, threads=threads,
                         progress=log)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
