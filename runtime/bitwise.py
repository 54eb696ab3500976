"""Bitwise comparison of step outputs, for the probes (:mod:`.probe`, :mod:`.rows`)."""

from __future__ import annotations

import numpy as np


def host_copy(x) -> np.ndarray:
    """A host copy of a cache buffer (numpy here; a torch tensor on the torch backend, widened to fp32 from
    16-bit floats, which numpy lacks in bf16: widening is exact, so bitwise comparisons still hold)."""
    if hasattr(x, "detach"):
        x = x.detach()
        return (x.float() if x.element_size() == 2 and x.is_floating_point() else x).cpu().numpy().copy()
    return np.array(x, copy=True)


def gap(a: np.ndarray, b: np.ndarray) -> float:
    """The largest |a - b| (0.0 exactly when bitwise equal; inf for other shapes or non-finite differences)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return float("inf")
    if np.array_equal(a, b):  # bitwise, NaN-free fast path
        return 0.0
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(d.max()) if np.isfinite(d).all() else float("inf")
