"""Drafter registry: prompt lookup needs nothing; trained kinds load their graphs from the bundle."""

from __future__ import annotations

from pathlib import Path

from ..bundle import BundleManifest
from ..errors import DraftMismatchError
from .base import DraftContext, Drafter
from .prompt_lookup import PromptLookupDrafter

DRAFTS = ("none", "prompt-lookup")


def make_drafter(name: str | None, bundle_dir: Path, manifest: BundleManifest, tree: str | None = None,
                 threads: int | None = None) -> Drafter | None:
    if name in (None, "", "none"):
        return None
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    raise DraftMismatchError(f"Unknown draft '{name}'; choose one of {', '.join(DRAFTS)}.")


__all__ = ["DRAFTS", "DraftContext", "Drafter", "PromptLookupDrafter", "make_drafter"]
