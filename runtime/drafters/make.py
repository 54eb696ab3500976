"""The runtime drafter factories the draft-kind descriptions name (``DraftKind.maker`` and ``.model``).

Each ``maker`` takes one :class:`DraftRequest` (the ``--draft`` name and what the engine
knows) and returns the :class:`Drafter`; each ``model`` factory loads a trained draft itself on ONNX
Runtime. :func:`~specdeploy.runtime.drafters.make_drafter` picks the factory by the kind's description.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..backends.base import Backend
from ..bundle import BundleManifest
from ..errors import DraftMismatchError
from ..tree import TreeSpec
from ..tree_table import tree_choice
from .base import Drafter
from .kinds import AUTO_MODELS, NGRAM, TRAINED_DRAFTS, describe, draft_name_error, hybrid_model, resolve
from .prompt_lookup import PromptLookupDrafter

MAX_LOOKUP_DEPTH = 16


@dataclass(frozen=True)
class DraftRequest:
    """What ``make_drafter`` was asked for: ``name`` and the engine's settings for it."""

    name: str
    bundle_dir: Path
    manifest: BundleManifest
    tree: str | None = None
    threads: int | None = None
    chains: bool = False
    backend: Backend | None = None
    suffix_cache_tokens: int | None = None


def tree_spec(tree: str | None, manifest: BundleManifest, max_depth: int) -> TreeSpec | None:
    """Parse and check ``--tree`` against the bundle's limits (None: the drafter's default)."""
    if tree in (None, "", "auto"):
        return None
    return tree_choice(tree, manifest.limits.max_tree, max_depth, dynamic=False)[0]


def prompt_lookup(req: DraftRequest) -> Drafter:
    spec = tree_spec(req.tree, req.manifest, MAX_LOOKUP_DEPTH)
    if spec is None:
        return PromptLookupDrafter()
    # A static tree bounds the lookup: branches at depth 1, tokens per branch, total nodes.
    branches = max(1, sum(1 for c in spec.choices if len(c) == 1))
    return PromptLookupDrafter(num_tokens=max(1, spec.depth), branches=branches, max_nodes=spec.num_nodes)


def ngram(req: DraftRequest) -> Drafter:
    from .ngram import load_ngram_drafter

    return load_ngram_drafter(Path(req.bundle_dir), req.manifest)


def bundle_lookup(req: DraftRequest) -> Drafter | None:
    """The bundle's n-gram drafter (lookup plus the model's own table), or None where it has no table."""
    return ngram(req) if any(d.kind == NGRAM for d in req.manifest.drafts) else None


def suffix_cache(req: DraftRequest):
    from .suffix import CACHE_TOKENS, SuffixCache

    size = CACHE_TOKENS if req.suffix_cache_tokens is None else req.suffix_cache_tokens
    if not isinstance(size, int) or size < 0:
        raise DraftMismatchError(f"The suffix cache's size must be 0 (off) or more tokens; got {size!r}.")
    return SuffixCache(size)


def suffix(req: DraftRequest) -> Drafter:
    from .suffix import SuffixDrafter

    return SuffixDrafter(suffix_cache(req), chains=req.chains)


def auto(req: DraftRequest) -> Drafter:
    from .auto import AutoDrafter, FreeSources
    from .suffix import SuffixDrafter

    suffix_drafter = SuffixDrafter(suffix_cache(req), chains=req.chains)  # the context's trie too: see FreeSources
    free = FreeSources(bundle_lookup(req) or PromptLookupDrafter(), suffix_drafter)
    has = {d.kind for d in req.manifest.drafts}
    model = next((k for k in AUTO_MODELS if k in has), None)
    if model is None:
        return free
    return AutoDrafter(trained(model, req), free, chains=req.chains)


def hybrid(req: DraftRequest) -> Drafter:
    from .hybrid import HybridDrafter

    model = hybrid_model(req.name)
    if model not in TRAINED_DRAFTS:
        raise DraftMismatchError(draft_name_error(req.name))
    # Lookup includes the model's own n-gram table where the bundle has one.
    return HybridDrafter(trained(model, req), lookup=bundle_lookup(req), chains=req.chains)


def trained_alone(req: DraftRequest) -> Drafter:
    """A trained draft alone, behind the rule: it drafts only where it pays."""
    from .hybrid import PaidDraft

    return PaidDraft(trained(req.name, req), chains=req.chains)


def trained(name: str, req: DraftRequest) -> Drafter:
    """The trained draft ``name`` itself, on ``req.backend``'s device where the backend offers one."""
    if req.backend is not None:
        own = req.backend.make_drafter(name, Path(req.bundle_dir), req.manifest, req.tree, req.chains)
        if own is not None:
            return own
    return resolve(describe(name).model)(name, req.bundle_dir, req.manifest, req.tree, req.threads, req.chains)


def chimera_model(name: str, bundle_dir: Path, manifest: BundleManifest, tree: str | None, threads: int | None,
                  chains: bool) -> Drafter:
    from .chimera import make_chimera_drafter

    return make_chimera_drafter(bundle_dir, manifest, tree=tree, threads=threads, chains=chains)


def heads_model(name: str, bundle_dir: Path, manifest: BundleManifest, tree: str | None, threads: int | None,
                chains: bool) -> Drafter:
    from .heads import make_heads_drafter

    return make_heads_drafter(name, bundle_dir, manifest, tree=tree, threads=threads, chains=chains)
