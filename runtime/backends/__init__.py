"""Backend registry. Heavy or GPU-only packages are imported only when their backend is chosen."""

from __future__ import annotations

from pathlib import Path

from ..bundle import BundleManifest
from ..errors import BackendUnavailableError
from .base import Backend, StepInputs, StepOutputs

BACKENDS = ("ort-cpu", "ort-cuda", "ort-trt", "trt", "torch")


def make_backend(name: str, bundle_dir: Path, manifest: BundleManifest, threads: int | None = None) -> Backend:
    if name in ("ort-cpu", "ort-cuda", "ort-trt"):
        from .ort import OrtBackend

        provider = {"ort-cpu": "cpu", "ort-cuda": "cuda", "ort-trt": "tensorrt"}[name]
        return OrtBackend(bundle_dir, manifest, provider=provider, threads=threads)
    if name in BACKENDS:
        raise BackendUnavailableError(f"The '{name}' backend is not available in this build of specdeploy.")
    raise BackendUnavailableError(f"Unknown backend '{name}'; choose one of {', '.join(BACKENDS)}.")


__all__ = ["BACKENDS", "Backend", "StepInputs", "StepOutputs", "make_backend"]
