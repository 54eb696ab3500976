"""Backend registry. Heavy or GPU-only packages are imported only when their backend is chosen.

The runtime never imports torch, so the torch reference backend lives in the exporter and joins the
registry through :func:`register_backend` when ``specdeploy.exporter.torch_backend`` is imported
(the CLI does that on demand).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..bundle import BundleManifest
from ..errors import BackendUnavailableError
from .base import Backend, StepInputs, StepOutputs

BACKENDS = ("ort-cpu", "ort-cpu-fp32", "ort-cpu-traced", "ort-cuda", "ort-trt", "trt", "torch")

BackendFactory = Callable[..., Backend]  # (bundle_dir, manifest, threads=None) -> Backend
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``make_backend(name, ...)`` call ``factory(bundle_dir, manifest, threads=threads)``."""
    _REGISTRY[name] = factory


def make_backend(name: str, bundle_dir: Path, manifest: BundleManifest, threads: int | None = None) -> Backend:
    """The backend ``name`` for the bundle (which graph serves which step is the step plan's choice)."""
    if name in _REGISTRY:
        return _REGISTRY[name](bundle_dir, manifest, threads=threads)
    if name in ("ort-cpu", "ort-cpu-fp32", "ort-cpu-traced"):
        from .ort import OrtBackend

        graph = None  # ort-cpu: the bundle's CPU graphs for 1-row and multi-row steps (cpu_base)
        if name == "ort-cpu-fp32":  # only the fused graph with fp32 weights
            graph = manifest.cpu_base(multi_row=True)
        elif name == "ort-cpu-traced":  # only the standard-op traced graph, to compare with the fused ones
            graph = manifest.graph("base", "trt")
        backend = OrtBackend(bundle_dir, manifest, provider="cpu", threads=threads, graph=graph)
        backend.name = name
        return backend
    if name in ("ort-cuda", "ort-trt"):
        from .ort import OrtCudaBackend

        return OrtCudaBackend(bundle_dir, manifest, provider="cuda" if name == "ort-cuda" else "tensorrt",
                              threads=threads)
    if name == "trt":
        from .trt import TrtBackend

        return TrtBackend(bundle_dir, manifest)
    if name.startswith("torch"):
        raise BackendUnavailableError(
            f"The '{name}' backend needs PyTorch and is not part of the lean runtime: use the specdeploy CLI, "
            "or import specdeploy.exporter.torch_backend before loading."
        )
    raise BackendUnavailableError(f"Unknown backend '{name}'; choose one of {', '.join(BACKENDS)}.")


__all__ = ["BACKENDS", "Backend", "StepInputs", "StepOutputs", "make_backend", "register_backend"]
