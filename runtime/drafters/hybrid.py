"""Hybrid drafting: prompt-lookup continuations and a trained draft's candidates in one verification tree.

For small models, retrieval drafting pays most reliably where the text repeats its context, and a
model draft where it does not. Each step the hybrid asks prompt lookup first (continuations of the
longest matching n-gram, their length chosen from the measured step-cost curve and the match
statistics; where the bundle has the model's n-gram table, lookup is :class:`NgramDrafter`, which
may answer from the table instead), then decides from what each source has earned:

* each source's acceptance is tracked online (Beta estimates of its first drafted token being accepted
  and of each later one, given the one before was), so a step's expected tokens are known;
* each step's cost comes from the backend's measured cost curve (rows verified), plus, for the model,
  its own call, timed here relative to a whole step.

The model is called only on steps where what it drafts is worth more expected tokens per unit of cost
than lookup's proposal (a plain step's 1.0 when lookup found nothing), so it never drags the free
source down. Where the step plan verifies chains only, the step drafts one chain: lookup's, the
model's, or none. With trees, a lookup match stays the main path and the model's nodes are merged in
under the node budget (a node whose token a lookup node already holds at the same place is shared).

The model does not run on the steps it does not draft: the base states of the tokens accepted
meanwhile are kept and handed to it with the next step it drafts, so a model with its own cache
(Chimera) catches up on all of them in that one call.
"""

from __future__ import annotations

import time

import numpy as np

from ..tree import DraftTree
from .base import DraftContext, Drafter
from .depth import CallTimer
from .prompt_lookup import ChainAcceptance, PromptLookupDrafter


class HybridDrafter(Drafter):
    keep_estimates = False  # True: what the model earned (acceptance, call cost) outlives a generation

    def __init__(self, model: Drafter, lookup: PromptLookupDrafter | None = None, chains: bool = False):
        self.model = model
        self.lookup = lookup or PromptLookupDrafter()
        self.chains = chains
        self.kind = f"hybrid:{model.kind}"
        self.sources = {"lookup": 0, "model": 0, "plain": 0}  # steps by the source of their main path, all sequences
        self._fresh_estimates()
        self.reset()

    def _fresh_estimates(self) -> None:
        self.model_acceptance = ChainAcceptance()
        self.timer = CallTimer()  # the model's call (a whole proposal) against the rest of a step

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()
        self._lookup_nodes = 0  # nodes 1..this of the last proposal came from lookup (0: lookup not run)
        self._model_nodes = 0  # drafted depth of the model's main path in the last proposal (0: not its own)
        self._model_depth = 1  # depth of the model's main path, as its last proposal had it
        # (hidden, layer states) accepted at each step since the model last ran
        self._pending: list[tuple[np.ndarray, np.ndarray | None]] = []
        if not self.keep_estimates:
            self._fresh_estimates()

    def check(self, manifest) -> None:
        self.model.check(manifest)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.model.feature_layers

    @property
    def needs_cost_curve(self) -> bool:
        return self.lookup.needs_cost_curve

    def use_cost_curve(self, cost_curve) -> None:
        self.lookup.use_cost_curve(cost_curve)

    # --- what each source has earned ------------------------------------------------------------------
    def _model_value(self) -> float:
        """Expected tokens per unit of cost of a step the model drafts."""
        depth = self._model_depth
        return float(self.model_acceptance.expected_tokens(depth)) / (self.lookup.step_cost(depth + 1)
                                                                      + self.timer.call_cost)

    def _run_model(self, ctx: DraftContext) -> DraftTree:
        if self._pending:
            kept = [*self._pending, (ctx.hidden, ctx.layers)]
            layers = None if ctx.layers is None else np.concatenate([lay for _, lay in kept])
            ctx = DraftContext(ctx.tokens, np.concatenate([h for h, _ in kept]), ctx.root_logits,
                               ctx.max_nodes, layers)
            self._pending.clear()
        t0 = time.perf_counter()
        drafted = self.model.propose(ctx)
        self.timer.timed(time.perf_counter() - t0, rows=len(ctx.hidden))
        self._model_depth = max(1, drafted.main_path().num_nodes - 1)
        return drafted

    # --- drafting ---------------------------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> DraftTree:
        self.timer.start()
        found = self.lookup.propose(ctx)
        matched = found.num_nodes > 1
        # The model runs only where a step it drafts is worth more than lookup's proposal (or a plain step):
        # with chains its chain replaces lookup's; with trees a lookup match with room left takes its nodes.
        use_model = self._model_value() > self.lookup.proposal_value(found) and (
            self.chains or not matched or found.num_nodes < ctx.max_nodes)
        if not use_model:
            self._pending.append((ctx.hidden, ctx.layers))
            self._lookup_nodes, self._model_nodes = found.num_nodes - 1, 0
            self.sources["lookup" if matched else "plain"] += 1
            return found.main_path() if self.chains else found
        drafted = self._run_model(ctx)
        if self.chains or not matched:
            tree = drafted.main_path() if self.chains else drafted
            self._lookup_nodes, self._model_nodes = 0, tree.main_path().num_nodes - 1
            self.sources["model"] += 1
            return tree
        # Merged under the lookup trie: the main path is lookup's, and the model's acceptance is not its own.
        self._lookup_nodes, self._model_nodes = found.num_nodes - 1, 0
        self.sources["lookup"] += 1
        return _merge(found, drafted, ctx.max_nodes)

    def finished(self, tokens, prompt_len: int) -> None:
        self.lookup.finished(tokens, prompt_len)
        self.model.finished(tokens, prompt_len)

    def profile(self) -> dict:
        out = {**self.timer.profile(), "steps_by_source": dict(self.sources)}
        lookup = self.lookup.profile().get("steps_by_source")
        return {**out, "lookup_steps_by_source": lookup} if lookup else out

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        self.timer.stop()
        if self._model_nodes:  # the model drafted this step's chain: it and the hybrid learn its acceptance
            self.model.accepted(nodes, tree)
            self.model_acceptance.update(len(nodes) - 1, self._model_nodes)
        if self._lookup_nodes:  # lookup learns from the accepted nodes that were its own (nodes 1..m)
            own = nodes[: 1 + int(np.sum((nodes[1:] >= 1) & (nodes[1:] <= self._lookup_nodes)))]
            self.lookup.accepted(own, tree)


def _merge(first: DraftTree, second: DraftTree, max_nodes: int) -> DraftTree:
    """``first``'s nodes, then ``second``'s (in its order, parents before children) under the node budget;
    a ``second`` node whose parent and token match a node already there is that node."""
    tokens, parents = first.tokens.tolist(), first.parents.tolist()
    at = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    where = {0: 0}  # second's node -> merged node
    for j in range(1, second.num_nodes):
        parent = where.get(int(second.parents[j]))
        if parent is None:  # its parent did not fit
            continue
        key = (parent, int(second.tokens[j]))
        if key in at:
            where[j] = at[key]
        elif len(tokens) < max_nodes:
            where[j] = at[key] = len(tokens)
            tokens.append(key[1])
            parents.append(parent)
    return DraftTree(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64))
