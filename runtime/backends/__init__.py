"""Backend registry. Heavy or GPU-only packages are imported only when their backend is chosen.

Built in: ``ort-cpu``, ``ort-cuda``, ``ort-trt`` and ``trt``. Other backends are plugins, declared as
entry points in the ``specdeploy.backends`` group (``name = "module:factory"``) and imported only when
chosen: the torch reference backend is one (it needs torch, which the runtime never imports, so it
lives in ``specdeploy.exporter.reference``). :func:`register_backend` adds one from code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

from ..bundle import BundleManifest
from ..errors import BackendUnavailableError
from .base import Backend, StepInputs, StepOutputs

BUILTIN_BACKENDS = ("ort-cpu", "ort-cuda", "ort-trt", "trt")
ENTRY_POINT_GROUP = "specdeploy.backends"

BackendFactory = Callable[..., Backend]  # (bundle_dir, manifest, threads=None) -> Backend
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``make_backend(name, ...)`` call ``factory(bundle_dir, manifest, threads=threads)``."""
    _REGISTRY[name] = factory


@functools.cache
def _plugins() -> dict:
    """The installed plugin backends (read once: every CLI command lists them for its --backend choice)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> tuple[str, ...]:
    """Every backend name ``make_backend`` knows: built in, registered, or installed as a plugin."""
    extra = sorted((set(_REGISTRY) | set(_plugins())) - set(BUILTIN_BACKENDS))
    return (*BUILTIN_BACKENDS, *extra)


def make_backend(name: str, bundle_dir: Path, manifest: BundleManifest, threads: int | None = None) -> Backend:
    """The backend ``name`` for the bundle (which graph serves which step is the step plan's choice)."""
    if name in _REGISTRY:
        return _REGISTRY[name](bundle_dir, manifest, threads=threads)
    if name == "ort-cpu":
        from .ort import OrtBackend

        return OrtBackend(bundle_dir, manifest, provider="cpu", threads=threads)
    if name in ("ort-cuda", "ort-trt"):
        from .ort import OrtCudaBackend

        return OrtCudaBackend(bundle_dir, manifest, provider="cuda" if name == "ort-cuda" else "tensorrt",
                              threads=threads)
    if name == "trt":
        from .trt import TrtBackend

        return TrtBackend(bundle_dir, manifest)
    plugin = _plugins().get(name)
    if plugin is not None:
        try:
            factory = plugin.load()
        except ImportError as exc:
            raise BackendUnavailableError(
                f"The '{name}' backend needs the package '{exc.name}', which is not installed here "
                f"(it is not part of the lean runtime).") from None
        return factory(bundle_dir, manifest, threads=threads)
    raise BackendUnavailableError(f"Unknown backend '{name}'; choose one of {', '.join(backend_names())}.")


__all__ = ["BUILTIN_BACKENDS", "Backend", "StepInputs", "StepOutputs", "backend_names", "make_backend",
           "register_backend"]
