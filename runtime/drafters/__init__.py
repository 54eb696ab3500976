"""Drafter registry: each draft kind's description (``kinds``) names the function that makes its drafter
(``DraftKind.maker``)."""

from __future__ import annotations

from pathlib import Path

from ..backends.base import Backend
from ..bundle import BundleManifest
from ..errors import DraftMismatchError
from .base import DraftContext, Drafter
from .kinds import DRAFTS, NONE, draft_name_error, known, resolve
from .make import DraftRequest, tree_spec
from .prompt_lookup import PromptLookupDrafter


def make_drafter(name: str | None, bundle_dir: Path, manifest: BundleManifest, tree: str | None = None,
                 threads: int | None = None, chains: bool = False, backend: Backend | None = None,
                 suffix_cache_tokens: int | None = None) -> Drafter | None:
    """The drafter ``name``; ``chains``: the step plan verifies chains only, so take the calibrated chain.
    A trained draft runs on ``backend``'s device where the backend offers it (``Backend.make_drafter``).
    ``suffix_cache_tokens`` sizes the suffix draft's cross-request cache (None: its default; 0: off)."""
    if name in (None, "", NONE):
        return None
    kind = known(name)
    if kind is None or kind.maker is None:
        raise DraftMismatchError(draft_name_error(name))
    request = DraftRequest(name, bundle_dir, manifest, tree, threads, chains, backend, suffix_cache_tokens)
    return resolve(kind.maker)(request)


__all__ = ["DRAFTS", "DraftContext", "Drafter", "PromptLookupDrafter", "make_drafter", "tree_spec"]
