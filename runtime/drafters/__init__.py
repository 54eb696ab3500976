"""Drafter registry: prompt lookup needs nothing; trained kinds load their graphs from the bundle."""

from __future__ import annotations

from pathlib import Path

from ..backends.base import Backend
from ..bundle import BundleManifest
from ..errors import DraftMismatchError
from ..tree import TreeSpec, tree_choice
from .base import DraftContext, Drafter
from .kinds import AUTO, DRAFTS, HYBRID, NGRAM, SUFFIX, TRAINED_DRAFTS, draft_name_error
from .prompt_lookup import PromptLookupDrafter

MAX_LOOKUP_DEPTH = 16
AUTO_MODELS = ("chimera", "medusa", "cerberus")  # the trained draft ``auto`` adds, the first the bundle has


def tree_spec(tree: str | None, manifest: BundleManifest, max_depth: int) -> TreeSpec | None:
    """Parse and check ``--tree`` against the bundle's limits (None: the drafter's default)."""
    if tree in (None, "", "auto"):
        return None
    return tree_choice(tree, manifest.limits.max_tree, max_depth, dynamic=False)[0]


def make_drafter(name: str | None, bundle_dir: Path, manifest: BundleManifest, tree: str | None = None,
                 threads: int | None = None, chains: bool = False, backend: Backend | None = None,
                 suffix_cache_tokens: int | None = None) -> Drafter | None:
    """The drafter ``name``; ``chains``: the step plan verifies chains only, so take the calibrated chain.
    A trained draft runs on ``backend``'s device where the backend offers it (``Backend.make_drafter``).
    ``suffix_cache_tokens`` sizes the suffix draft's cross-request cache (None: its default; 0: off)."""
    if name in (None, "", "none"):
        return None
    if name == "prompt-lookup":
        spec = tree_spec(tree, manifest, MAX_LOOKUP_DEPTH)
        if spec is None:
            return PromptLookupDrafter()
        # A static tree bounds the lookup: branches at depth 1, tokens per branch, total nodes.
        branches = max(1, sum(1 for c in spec.choices if len(c) == 1))
        return PromptLookupDrafter(num_tokens=max(1, spec.depth), branches=branches, max_nodes=spec.num_nodes)
    if name in (SUFFIX, AUTO):
        from .suffix import CACHE_TOKENS, SuffixCache, SuffixDrafter

        size = CACHE_TOKENS if suffix_cache_tokens is None else suffix_cache_tokens
        if not isinstance(size, int) or size < 0:
            raise DraftMismatchError(f"The suffix cache's size must be 0 (off) or more tokens; got {size!r}.")
        if name == SUFFIX:
            return SuffixDrafter(SuffixCache(size), chains=chains)
        suffix = SuffixDrafter(SuffixCache(size), chains=chains, local=False)  # lookup covers the context
        from .auto import AutoDrafter, FreeSources

        has = {d.kind for d in manifest.drafts}
        lookup = make_drafter(NGRAM, bundle_dir, manifest) if NGRAM in has else PromptLookupDrafter()
        free = FreeSources(lookup, suffix)
        model = next((k for k in AUTO_MODELS if k in has), None)
        if model is None:
            return free
        return AutoDrafter(_trained(model, bundle_dir, manifest, tree, threads, chains, backend), free,
                           chains=chains)
    if name == NGRAM:
        from .ngram import load_ngram_drafter

        return load_ngram_drafter(Path(bundle_dir), manifest)
    if name == HYBRID or name.startswith(HYBRID + ":"):
        from .hybrid import HybridDrafter

        model = name.partition(":")[2] or "chimera"
        if model not in TRAINED_DRAFTS:
            raise DraftMismatchError(draft_name_error(name))
        # Lookup includes the model's own n-gram table where the bundle has one.
        lookup = make_drafter(NGRAM, bundle_dir, manifest) if any(d.kind == NGRAM for d in manifest.drafts) else None
        return HybridDrafter(_trained(model, bundle_dir, manifest, tree, threads, chains, backend), lookup=lookup,
                             chains=chains)
    if name in TRAINED_DRAFTS:  # alone, behind the rule: it drafts only where it pays
        from .hybrid import PaidDraft

        return PaidDraft(_trained(name, bundle_dir, manifest, tree, threads, chains, backend), chains=chains)
    raise DraftMismatchError(draft_name_error(name))


def _trained(name: str, bundle_dir: Path, manifest: BundleManifest, tree: str | None, threads: int | None,
             chains: bool, backend: Backend | None) -> Drafter:
    """The trained draft ``name`` itself, on ``backend``'s device where the backend offers one."""
    if backend is not None:
        own = backend.make_drafter(name, Path(bundle_dir), manifest, tree, chains)
        if own is not None:
            return own
    if name == "chimera":
        from .chimera import make_chimera_drafter

        return make_chimera_drafter(bundle_dir, manifest, tree=tree, threads=threads, chains=chains)
    from .heads import make_heads_drafter

    return make_heads_drafter(name, bundle_dir, manifest, tree=tree, threads=threads, chains=chains)


__all__ = ["DRAFTS", "DraftContext", "Drafter", "PromptLookupDrafter", "make_drafter"]
