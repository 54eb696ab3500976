"""The real SmolLM2-135M-Instruct bundles (exported once per test run), for the integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The shipped Chimera fuses EAGLE-3's low, mid and high base layers (graphs/weights/README.md), so the real
# bundles tap them, as the main job's does (scripts/setup_and_run.sh: export base --feature-layers eagle3).
SHIPPED_TAPS = "eagle3"


@pytest.fixture(scope="session")
def real_bundle(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct bundle (exported once; ~80 s on 2 cores)."""
    from specdeploy.exporter.export.base import export_base

    pre = os.environ.get("SPECDEPLOY_TEST_BUNDLE")
    if pre and Path(pre, "manifest.json").is_file():
        return Path(pre)
    out = tmp_path_factory.mktemp("real") / "smollm2"
    export_base(None, out, max_context=2048, feature_layers=SHIPPED_TAPS, progress=lambda m: None)
    return out


@pytest.fixture(scope="session")
def real_quant_bundle(tmp_path_factory, real_bundle):
    """``make("q4_1" | "int4")``: SmolLM2 exported at that precision, once per session (~80 s each).

    Shared: tests that add drafts to it add them for the later ones too, and none removes anything."""
    from specdeploy.exporter.export.base import export_base
    from specdeploy.runtime.bundle import read_manifest

    cache: dict[str, Path] = {}

    def make(precision: str) -> Path:
        if precision not in cache:
            out = tmp_path_factory.mktemp(f"real_{precision}") / f"smollm2-{precision}"
            export_base(read_manifest(real_bundle).source.path, out, max_context=2048, precision=precision,
                        feature_layers=SHIPPED_TAPS, progress=lambda m: None)
            cache[precision] = out
        return cache[precision]

    return make
