"""Fresh draft-head modules by kind: the one map from a heads kind to the module that implements it."""

from __future__ import annotations

from .cerberus import CerberusHeads
from .heads import HeadsConfig, HeadsModule
from .medusa import MedusaHeads

HEADS_BUILDERS = {cls.kind: cls for cls in (MedusaHeads, CerberusHeads)}  # each module names its kind


def build_heads(config: HeadsConfig) -> HeadsModule:
    """A fresh (zero-initialised, i.e. identity) heads module of ``config.kind``."""
    if config.kind not in HEADS_BUILDERS:
        raise ValueError(f"unknown heads kind {config.kind!r}; choose one of {', '.join(HEADS_BUILDERS)}")
    return HEADS_BUILDERS[config.kind](config)
