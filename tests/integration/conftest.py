"""The real SmolLM2-135M-Instruct bundles (exported once per test run), for the integration tests."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

# The shipped Chimera fuses EAGLE-3's low, mid and high base layers (graphs/weights/README.md), so the real
# bundles tap them, as the main job's does (scripts/setup_and_run.sh: export base --feature-layers eagle3).
SHIPPED_TAPS = "eagle3"


@pytest.fixture(scope="session")
def real_bundle(tmp_path_factory, real_bundles_built) -> Path:
    """The real SmolLM2-135M-Instruct bundle (exported once; ~80 s on 2 cores)."""
    from specdeploy.exporter.export.base import export_base

    pre = os.environ.get("SPECDEPLOY_TEST_BUNDLE")
    if pre and Path(pre, "manifest.json").is_file():
        out = Path(pre)
    else:
        out = tmp_path_factory.mktemp("real") / "smollm2"
        export_base(None, out, max_context=2048, feature_layers=SHIPPED_TAPS, progress=lambda m: None)
    real_bundles_built["fp32"] = out
    return out


@pytest.fixture(scope="session")
def real_quant_bundle(tmp_path_factory, real_bundle, real_bundles_built):
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
            cache[precision] = real_bundles_built[precision] = out
        return cache[precision]

    return make


@pytest.fixture(scope="session")
def drafted(real_bundle, tmp_path_factory):
    """A copy of the real bundle with the three shipped drafts exported into it, and validate's checks of it (its
    base graphs' and its drafts'): made and validated once for every test that reads them."""
    import shutil

    from specdeploy.exporter.check.validate import validate_bundle
    from specdeploy.exporter.export.draft import export_draft

    weights = Path(__file__).resolve().parents[2] / "graphs" / "weights"
    bundle = tmp_path_factory.mktemp("drafted") / "real"
    shutil.copytree(real_bundle, bundle)
    for kind in ("chimera", "medusa", "cerberus"):
        export_draft(bundle, kind, weights / f"{kind}.safetensors", progress=lambda m: None)
    return bundle, validate_bundle(bundle, progress=lambda m: None)


class PlainRuns:
    """Plain greedy replies on the session's real bundles, each decoded once per session on one open plain engine
    per bundle (and step plan): the references the speculative outputs of several tests are held to.

    A copy of a session bundle with drafts added has the same base graphs, so the same verdicts and plan: tests
    hold its engines to the original's references (``same_plan`` checks it)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._engines: dict[tuple[str, str | None], Any] = {}
        self._replies: dict[tuple, list[int]] = {}

    def engine(self, bundle: Path, step_plan: str | None = None):
        """The open plain engine on ``bundle`` (loaded once: a load hashes every file and opens sessions)."""
        from specdeploy.runtime import load

        key = (str(bundle), step_plan)
        if key not in self._engines:
            self._engines[key] = self._stack.enter_context(load(bundle, draft=None, step_plan=step_plan))
        return self._engines[key]

    def refs(self, bundle: Path, prompts: list[str], tokens: int,
             step_plan: str | None = None) -> list[tuple[list[int], list[int]]]:
        """(chat-template ids, plain greedy reply of ``tokens``) per prompt."""
        from specdeploy.runtime.decode import GenerationConfig

        eng = self.engine(bundle, step_plan)
        out = []
        for p in prompts:
            ids = eng.encode(p, chat=True)
            key = (str(bundle), step_plan, tuple(ids), tokens)
            if key not in self._replies:
                self._replies[key] = eng.generate_ids(ids, GenerationConfig(tokens))
            out.append((ids, self._replies[key]))
        return out

    def same_plan(self, bundle: Path, other, step_plan: str | None = None) -> None:
        """``other`` (an engine) runs the plan the references were decoded on."""
        plan = self.engine(bundle, step_plan).plan
        assert (other.plan.candidate, other.plan.exact) == (plan.candidate, plan.exact), (other.plan.reason,
                                                                                          plan.reason)

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="session")
def plain_runs():
    runs = PlainRuns()
    yield runs
    runs.close()
