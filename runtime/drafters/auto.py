"""``--draft auto``: each step, the draft source worth the most expected tokens per unit of cost, or a plain step.

The free sources are prompt lookup (the model's own n-gram table with it, where the bundle has one:
:class:`~.ngram.NgramDrafter`) and the suffix drafter (this request's context with frequencies, and the
outputs of earlier requests in the engine's shared cache: :class:`~.suffix.SuffixDrafter`). Each sizes
its proposal on the backend's cost curve from the acceptance it has earned, so each knows what its
proposal is worth: expected tokens over the step's cost. :class:`FreeSources` asks both and keeps the
one worth more; a proposal worth no more than a plain step's 1.0 is a plain step. The suffix drafter is
asked with lookup's proposal as the bar to beat, so it prices a match before it expands it and makes
no tree that could not be kept (it wins few steps); what it learns is the same.

Both read this request's context. Lookup prices a match by what matches of its n-gram size (3 at most) earned
on average; the suffix drafter by how often each continuation followed its longest match (up to 8 tokens) and
what matches of that length earned. Where an answer copies a stretch of its context (a second turn that
rewrites the first answer, a code edit), the suffix's price is the sharper one: it drafts the copy as one
long chain where lookup adds a second branch, and it stays plain where lookup's short match would fail. (With
the shared cache alone, ``auto`` ran 0.92x ``suffix`` in the decode loop on Spec-Bench's second turns.)

Where the bundle has a trained draft, :class:`~.hybrid.HybridDrafter` sits on top with the same rule:
the model is called only when its expected tokens per unit of cost, its own call's measured time
included, beat the free sources' proposal; with trees, a free match that pays takes the model's nodes
under its own. A source that stopped paying keeps its low estimate and is not called; so that it can
recover, the model is tried on one step in :data:`RETRY_EVERY` where nothing else pays.

Verification is the same whatever is drafted, so greedy output equals plain decoding and sampling
stays exact.
"""

from __future__ import annotations

import numpy as np

from ..tree import DraftTree
from .base import DraftContext, Drafter
from .hybrid import RETRY_EVERY, HybridDrafter
from .kinds import AUTO, SUFFIX
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter

__all__ = ["RETRY_EVERY", "AutoDrafter", "FreeSources"]


class _SuffixCacheView:
    """The suffix drafter's shared cache and namespace, as the drafter holding it exposes them (the engine
    sets ``namespace`` per generation; tests read ``cache``)."""

    def _suffix(self) -> SuffixDrafter:
        raise NotImplementedError

    @property
    def namespace(self) -> str:
        return self._suffix().namespace

    @namespace.setter
    def namespace(self, value: str) -> None:
        self._suffix().namespace = value

    @property
    def cache(self):
        return self._suffix().cache


class FreeSources(_SuffixCacheView, Drafter):
    """Prompt lookup (or n-grams) and the suffix drafter: the better proposal each step."""

    kind = AUTO

    def __init__(self, lookup: PromptLookupDrafter, suffix: SuffixDrafter):
        self.lookup, self.suffix = lookup, suffix
        self.sources = {"lookup": 0, SUFFIX: 0, "plain": 0}
        self._used: Drafter | None = None

    @property
    def needs_cost_curve(self) -> bool:
        return True

    def use_cost_curve(self, cost_curve) -> None:
        self.lookup.use_cost_curve(cost_curve)
        self.suffix.use_cost_curve(cost_curve)

    def reset(self) -> None:
        self.lookup.reset()
        self.suffix.reset()
        self._used = None

    def step_cost(self, rows: int) -> float:
        return self.lookup.step_cost(rows)

    def recall(self) -> Drafter | None:
        """The suffix drafter where the shared cache is on (text met in earlier requests, and in this one's context);
        with the cache off, none: a batch's plain steps then leave the context to lookup, on the steps that draft."""
        return self.suffix if self.suffix.cache.max_tokens else None

    def propose(self, ctx: DraftContext) -> DraftTree:
        by_lookup = self.lookup.propose(ctx)
        value, by_suffix = self.suffix.draft(ctx, by_lookup.value)  # a tree only where it may beat lookup's
        plain = self.lookup.worth(None, 0, 1)
        if by_suffix is not None and value > by_lookup.value:  # the suffix's proposal is worth more (ties: lookup's)
            best, used, drafted = by_suffix, SUFFIX, value > plain
        else:
            best, used, drafted = by_lookup, "lookup", by_lookup.num_nodes > 1  # what lookup's own rule chose
        if not drafted:
            self._used = None
            self.sources["plain"] += 1
            if by_lookup.num_nodes == 1 and by_lookup.value == plain:  # lookup's own plain step: the same proposal
                return by_lookup
            return DraftTree.root(int(ctx.tokens[-1])).priced(plain)
        self._used = self.suffix if used == SUFFIX else self.lookup
        self.sources[used] += 1
        return best

    @property
    def source(self) -> str:
        return SUFFIX if self._used is self.suffix else "lookup"

    def observed(self, emitted) -> None:
        if self._used is self.suffix:  # lookup learns from whole verdicts only
            self.suffix.observed(emitted)

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        if self._used is not None:  # only the source that drafted learns from this step
            self._used.accepted(nodes, tree)

    def finished(self, tokens, prompt_len: int) -> None:
        self.suffix.finished(tokens, prompt_len)
        self.lookup.finished(tokens, prompt_len)

    def _suffix(self) -> SuffixDrafter:
        return self.suffix

    def profile(self) -> dict:
        return {"steps_by_source": dict(self.sources), **self.suffix.profile()}


class AutoDrafter(_SuffixCacheView, HybridDrafter):
    """The free sources, and a trained draft where one pays (the hybrid's rule), retried now and then."""

    keep_estimates = True  # a draft that does not pay on this model and machine is not retried at every request

    def __init__(self, model: Drafter, free: FreeSources, chains: bool = False):
        super().__init__(model, lookup=free, chains=chains)
        self.kind = f"{AUTO}:{model.kind}"

    def _suffix(self) -> SuffixDrafter:
        return self.lookup.suffix
