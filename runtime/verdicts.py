"""The verdict cache: the probe's result for each step-plan candidate, kept per machine in the user cache.

A verdict is keyed by (:data:`PROBE_VERSION`, CPU model and flags (:func:`.machine.machine_id`), the backend's
runtime version, backend, threads, graph hashes, candidate, depth); the file is ``exactness.json`` in
:func:`cache_dir`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .machine import machine_id
from .plan import Candidate, ProbeCheck, ProbeResult

if TYPE_CHECKING:
    from .backends.base import Backend
    from .bundle import BundleManifest

PROBE_VERSION = 4


def cache_dir() -> Path:
    """``$SPECDEPLOY_CACHE``, else ``$XDG_CACHE_HOME/specdeploy``, else ``~/.cache/specdeploy``."""
    env = os.environ.get("SPECDEPLOY_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdeploy"


def verdict_key(backend: Backend, manifest: BundleManifest, cand: Candidate, depth: int) -> str:
    graphs = ",".join(g.sha for g in backend.graphs(cand.split, cand.gathered))
    rows = "/rows" if cand.gathered and backend.can_batch_rows else ""  # the verdict holds the rows checks
    parts = (f"v{PROBE_VERSION}", machine_id(), backend.runtime_version(), backend.name, f"threads={backend.threads}",
             graphs, f"{cand.name}/{cand.min_rows}{rows}", f"depth={depth}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def _verdict_file() -> Path:
    return cache_dir() / "exactness.json"


def _read_verdicts() -> dict:
    try:
        return json.loads(_verdict_file().read_text())
    except (OSError, ValueError):
        return {}


def cached_verdict(key: str) -> ProbeResult | None:
    raw = _read_verdicts().get(key)
    if not isinstance(raw, dict):
        return None
    try:
        cand = Candidate(**raw["candidate"])
        checks = tuple(ProbeCheck(c["what"], float(c["max_abs"])) for c in raw["checks"])
        return ProbeResult(cand, checks, float(raw["plain_ms"]), cached=True)
    except (KeyError, TypeError, ValueError):
        return None


def store_verdict(key: str, res: ProbeResult) -> None:
    """Best effort: an unwritable cache only means the probe runs again next time."""
    try:
        path = _verdict_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        verdicts = _read_verdicts()
        raw = dataclasses.asdict(res)
        raw.pop("cached", None)
        raw["machine"] = machine_id()
        verdicts[key] = raw
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdicts, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


__all__ = ["PROBE_VERSION", "cache_dir", "cached_verdict", "store_verdict", "verdict_key"]
