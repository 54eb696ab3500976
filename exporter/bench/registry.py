"""Every variant ``specdeploy bench`` knows, ours and the peers', and the runner kinds that time them."""

from __future__ import annotations

from specdeploy.exporter.bench.peers import PEER_RUNNERS, PEER_VARIANTS
from specdeploy.exporter.bench.spec import Runner, VariantSpec
from specdeploy.exporter.bench.variants import OWN_RUNNERS, OWN_VARIANTS
from specdeploy.runtime.bundle import BundleManifest

VARIANTS: dict[str, VariantSpec] = {v.name: v for v in (*OWN_VARIANTS, *PEER_VARIANTS)}
RUNNERS: dict[str, type[Runner]] = {**OWN_RUNNERS, **PEER_RUNNERS}


def unavailable(spec: VariantSpec, manifest: BundleManifest) -> str | None:
    """Why ``spec`` cannot run on this bundle here (a missing package or draft, or its runner's check), or None."""
    note = spec.unavailable(manifest)
    if note is None and spec.runner in RUNNERS:
        note = RUNNERS[spec.runner].unavailable(spec, manifest)
    return note
