"""Hybrid drafting: prompt-lookup continuations and a trained draft's candidates in one verification tree.

For small models, retrieval drafting pays most reliably where the text repeats its context, and a
model draft where it does not. Each step the hybrid asks prompt lookup first (continuations of the
longest matching n-gram, their length chosen from the measured step-cost curve and the match
statistics; where the bundle has the model's n-gram table, lookup is :class:`NgramDrafter`, which
may answer from the table instead), then decides from what each source has earned:

* each source's acceptance is tracked online (Beta estimates of its first drafted token being accepted
  and of each later one, given the one before was), so a step's expected tokens are known;
* each step's cost comes from the backend's measured cost curve (rows verified); for the model, from
  the wall time of the decode iterations it drafted against those that ran plainly (:class:`StepClock`:
  its call, its rows and its own cache upkeep, all included), and until both are timed, from the cost
  curve plus its call timed against the rest of a step.

The model is called only on steps where what it drafts is worth more expected tokens per unit of cost
than lookup's proposal (a plain step's 1.0 when lookup found nothing), so it never drags the free
source down. Where the step plan verifies chains only, the step drafts one chain: lookup's, the
model's, or none. With trees, a lookup match stays the main path and the model's nodes are merged in
under the node budget (a node whose token a lookup node already holds at the same place is shared).

Where the model has a gate of its own (Cerberus), the gate is asked only on steps the rule gives the model.
A model that stopped paying keeps its low estimate and is not called; so that it can recover, it is tried
again after :data:`RETRY_EVERY` plain steps in a row, and after twice as many each time a retry does not
pay, up to :data:`MAX_RETRY_EVERY` (a retry is not free: a model with its own cache, as Chimera, catches
up on the tokens since its last call, up to :attr:`HybridDrafter.catch_up` of them). :class:`PaidDraft`
is the same rule with no free source: an explicit trained draft (``--draft chimera`` and the like) drafts
only on the steps where it is worth more than a plain step, and never drags decoding below plain.

With trees, a model called beside a lookup match has its nodes merged under lookup's; it then learns what
its own chain would have earned (its tokens, as far as the accepted path agrees with them), so that merges
that do not pay stop as drafts of its own would.

The model does not run on the steps it does not draft, and takes in nothing there: the base states of the
tokens accepted meanwhile (the prompt's included, until the rule first wants the model) are kept as the
decode loop handed them over, and given to it, joined, with the next step it drafts, so a model with its
own cache (Chimera) catches up in that one call. It takes in the latest :attr:`HybridDrafter.catch_up`
of them at most: the slots before stay empty and unseen, so a try after a long prompt or a long plain
run costs a bounded call, not one row per token (on MT-bench, a chain's acceptance was the same). That
call is priced before it is made: its rows past a typical call's, at their measured time per row
(:meth:`~.depth.CallTimer.catch_up_cost`), shared among the calls that a catch-up has served on average,
since a model that keeps drafting catches up once. So a model that is tried, drafts a step or two and sits
out again is tried less often, and one that drafts on and on pays its catch-up once. On a step the model
sits out, the hybrid prices it, times the step and keeps two references; the rest is the free source's work.

In a batch's step (``DraftContext.sequences`` > 1) a call delays every sequence in it, so it is priced against
this sequence's share of the step: ``sequences`` times its cost against the whole step. A batch's sequences share
one timer of the model's calls (what a typical call and a catch-up cost), as they share what it earned, and a
call that no sequence has timed yet is not made in a shared step (at 32 sequences on a CPU, a call costs more
than the tokens it could add).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..tree import DraftTree
from .base import DraftContext, Drafter
from .depth import TYPICAL_ROWS, CallTimer
from .prompt_lookup import ChainAcceptance, PromptLookupDrafter

CATCH_UP_CALLS = 4  # calls a catch-up is taken to serve before the model has been called (a prior of one catch-up)
RETRY_EVERY = 64  # plain steps between two tries of a model draft that stopped paying (at first)
MAX_RETRY_EVERY = 1024  # ... doubled after each retry that did not pay, up to this


class StepClock:
    """Running means of whole decode iterations (one proposal to the next) by what the step was: drafted
    by the model ("model") or run plainly ("plain"). Their ratio is what a model step really costs in
    plain steps on this machine, everything included.

    Single iterations on a shared 2-core machine are noisy (a pause of the OS or the allocator can take
    several steps' time), so each mean is a slow running mean (weight :attr:`RATE` once it has its
    first samples) of samples clipped at :attr:`CLIP` times the mean so far."""

    MIN_SAMPLES = 16  # of each kind before the ratio is trusted
    RATE = 0.02
    CLIP = 3.0

    def __init__(self) -> None:
        self.mean: dict[str, float] = {}
        self.count = {"model": 0, "plain": 0}
        self._t0: float | None = None
        self.kind: str | None = None  # what the running iteration is ("model", "plain", or None: not timed)

    def tick(self) -> None:
        """A new iteration starts: the one that ended is timed under its kind."""
        now = time.perf_counter()
        if self._t0 is not None and self.kind is not None:
            n = self.count[self.kind] = self.count[self.kind] + 1
            old = self.mean.get(self.kind, 0.0)
            sample = now - self._t0 if n <= 2 else min(now - self._t0, self.CLIP * old)
            self.mean[self.kind] = old + max(1.0 / n, self.RATE) * (sample - old)  # a plain mean at first
        self._t0, self.kind = now, None

    def pause(self) -> None:
        """Between generations: the next iteration's start is not timed (a prefill comes first)."""
        self._t0 = None

    def ratio(self) -> float | None:
        """A model-drafted iteration's time over a plain one's, once both are timed enough."""
        if min(self.count.values()) < self.MIN_SAMPLES:
            return None
        return self.mean["model"] / self.mean["plain"]


class HybridDrafter(Drafter):
    keep_estimates = False  # True: what the model earned (acceptance, call cost) outlives a generation
    # True: the model drafts every step, whatever it has earned: for measuring a draft's acceptance (the
    # output stays exact; the speed may fall below plain decoding). ``specdeploy.exporter.train.ondevice`` keep.
    always_model = False
    catch_up = 64  # the most base states a model call takes in (the latest; the older stay unseen)

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
        self.clock = StepClock()  # whole iterations it drafted against plain ones
        self._plain_run = 0  # plain steps in a row (nothing paid), across generations where estimates are kept
        self._retry_every = RETRY_EVERY
        self._retried = False  # the last step was a retry: the next one tells whether it paid
        self._retry_now = False

    def share_estimates(self, other: HybridDrafter) -> None:
        """What the model has earned and what its calls cost, as ``other`` has them: a batch's sequences share
        them, as one sequence keeps them across requests (``keep_estimates``), so that each prices its first call
        and catch-up by what the others measured."""
        self.model_acceptance, self.timer = other.model_acceptance, other.timer

    @property
    def model_calls(self) -> int:
        """The model's calls (its timer's, shared by a batch's sequences)."""
        return self.timer.calls

    @property
    def catch_ups(self) -> int:
        """Those of them that caught up on more than TYPICAL_ROWS states."""
        return self.timer.catch_ups

    def recall(self) -> Drafter | None:
        """Its free sources' recall; the step that drafts alone is not one of its iterations, so its clock does not
        time it."""
        self.clock.pause()
        return self.lookup.recall()

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()
        self._lookup_nodes = 0  # nodes 1..this of the last proposal came from lookup (0: lookup not run)
        self._model_nodes = 0  # drafted depth of the model's main path in the last proposal (0: not its own)
        self._model_chose = False  # the model's chain was this step's proposal (whatever its depth)
        self._model_depth = 1  # depth of the model's main path, as its last proposal had it
        # The base states of each step's accepted nodes since the model last ran (its catch-up), as the decode loop
        # handed them over: [A_i, H] and [A_i, taps*H] each. No tuples, so nothing the garbage collector tracks.
        self._pending_hidden: list[np.ndarray] = []
        self._pending_layers: list[np.ndarray] = []
        self._pending_rows = 0  # their rows
        self._merged = False  # the last proposal holds the model's nodes under lookup's
        self._model_path: list[int] = []  # then, the tokens of the model's own main path
        if not self.keep_estimates:
            self._fresh_estimates()
        self.clock.pause()

    def check(self, manifest) -> None:
        self.model.check(manifest)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.model.feature_layers

    @property
    def needs_cost_curve(self) -> bool:
        return self.lookup.needs_cost_curve or self.model.needs_cost_curve

    def use_cost_curve(self, cost_curve) -> None:
        self.lookup.use_cost_curve(cost_curve)
        self.model.use_cost_curve(cost_curve)  # the model sizes its own chains on the same curve

    # --- what each source has earned ------------------------------------------------------------------
    def _call_rows(self, ctx: DraftContext) -> int:
        """The base states a model call on this step would take in (:meth:`_run_model`)."""
        return min(self._pending_rows + len(ctx.hidden), self.catch_up)

    def _calls_per_catch_up(self) -> float:
        """How many calls a catch-up has served on average (the call that caught up included), a prior of one
        catch-up serving :data:`CATCH_UP_CALLS` calls counted in."""
        return (self.model_calls + CATCH_UP_CALLS) / (self.catch_ups + 1)

    def _model_value(self, rows: int, sequences: int = 1) -> float:
        """Expected tokens per unit of cost of a step the model drafts, its call taking in ``rows`` base states
        (infinite on a retry); reads, changes nothing.

        A call over more than :data:`TYPICAL_ROWS` states (after the prompt, or after the model sat out for a
        while) costs what it takes beyond a typical call (:meth:`CallTimer.catch_up_cost`, measured). That buys
        the calls after it too, so it is shared among the calls a catch-up has served on average.

        In a step that ``sequences`` > 1 share, the call delays all of them: against this sequence's share of the
        step it costs ``sequences`` times what it costs against the whole step (the timer's step is then the
        batch's). Its rows are the rows rule's to price (:func:`~..rows.rows_per_sequence`). A call not timed yet
        is not made in a shared step: its cost is unknown, and every sequence would pay it."""
        if self.always_model or self._retry_now:
            return float("inf")
        depth = self._model_depth
        shared = sequences > 1
        cost = None if shared else self.clock.ratio()  # catching-up steps are not in it; nor are shared ones
        if cost is None:  # its rows on the cost curve, and its call against a step
            if shared and not self.timer.call_cost:
                return 0.0
            cost = self.lookup.step_cost(depth + 1) + self.timer.call_cost * sequences
        cost += self.timer.catch_up_cost(rows) * sequences / self._calls_per_catch_up()
        return float(self.model_acceptance.expected_up_to(depth)[depth]) / cost

    def _keep(self, ctx: DraftContext) -> None:
        """The model sits this step out: keep its accepted nodes' states for the model's next call."""
        self._pending_hidden.append(ctx.hidden)
        self._pending_rows += len(ctx.hidden)
        if ctx.layers is not None:
            self._pending_layers.append(ctx.layers)

    def _run_model(self, ctx: DraftContext) -> DraftTree:
        if self._pending_hidden or len(ctx.hidden) > self.catch_up:
            # Catch up: the latest states since its last call (at most catch_up), then this step's.
            last = -self.catch_up
            hidden = np.concatenate([*self._pending_hidden, ctx.hidden])[last:]  # [<= catch_up, H]
            layers = None if ctx.layers is None else np.concatenate([*self._pending_layers, ctx.layers])[last:]
            ctx = dataclasses.replace(ctx, hidden=hidden, layers=layers)
            self._pending_hidden.clear()
            self._pending_layers.clear()
            self._pending_rows = 0
        t0 = time.perf_counter()
        drafted = self.model.propose(ctx)
        rows = len(ctx.hidden)
        self.timer.timed(time.perf_counter() - t0, rows=rows)
        self._model_depth = max(1, drafted.main_path().num_nodes - 1)
        return drafted

    # --- drafting ---------------------------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> DraftTree:
        self.clock.tick()
        if ctx.sequences > 1:  # a batch's iteration, not one of its own: its clock times only steps alone
            self.clock.pause()
        rows = self._call_rows(ctx)  # what a model call would take in on this step
        catching_up = rows > TYPICAL_ROWS  # a model call over many rows is not an ordinary step
        after_retry, self._retried = self._retried, False
        tree = self._propose(ctx, rows)
        plain = tree.num_nodes == 1
        self._plain_run = self._plain_run + 1 if plain else 0
        if self._retry_now:
            self._retried, self._retry_now = True, False
        elif after_retry:  # the rule kept the model after its retry: it pays again; else wait twice as long
            self._retry_every = RETRY_EVERY if self._model_chose else min(2 * self._retry_every, MAX_RETRY_EVERY)
        self.clock.kind = "plain" if plain else None
        if self._model_chose and not catching_up:  # the model's call was paid, whatever it drafted
            self.clock.kind = "model"
        return tree

    def _propose(self, ctx: DraftContext, rows: int) -> DraftTree:
        self.timer.start()
        if not self.always_model and self._plain_run >= self._retry_every:  # nothing paid for a while: one more try
            self._plain_run, self._retry_now = 0, True
        found = self.lookup.propose(ctx)
        matched = found.num_nodes > 1
        # The model runs only where a step it drafts is worth more than lookup's proposal (or a plain step):
        # with chains its chain replaces lookup's; with trees a lookup match with room left takes its nodes.
        use_model = (self.chains or not matched or found.num_nodes < ctx.max_nodes) and (
            self._model_value(rows, ctx.sequences) > found.value) and self.model.wants_draft(ctx)
        if not use_model:
            self._keep(ctx)
            self._lookup_nodes, self._model_nodes, self._model_chose = found.num_nodes - 1, 0, False
            self._merged = False
            self.sources["lookup" if matched else "plain"] += 1
            return found.main_path() if self.chains else found
        drafted = self._run_model(ctx)
        if self.chains or not matched:
            tree = drafted.main_path() if self.chains else drafted
            self._lookup_nodes, self._model_nodes, self._model_chose = 0, tree.main_path().num_nodes - 1, True
            self._merged = False
            self.sources["model" if tree.num_nodes > 1 else "plain"] += 1
            return tree
        # Merged under the lookup trie: the main path is lookup's; the model learns what its own chain would have
        # earned (its tokens along the accepted path), so that merges it does not pay for stop.
        self._lookup_nodes, self._model_nodes, self._model_chose = found.num_nodes - 1, 0, False
        self._merged = True
        self._model_path = drafted.main_path().tokens[1:].tolist()
        self.sources["lookup"] += 1
        return _merge(found, drafted, ctx.max_nodes)

    @property
    def source(self) -> str:
        return "model" if self._model_chose else self.lookup.source

    def observed(self, emitted) -> None:
        if self._lookup_nodes and not self._merged:  # its free sources' own proposal
            self.lookup.observed(emitted)

    def finished(self, tokens, prompt_len: int) -> None:
        self.lookup.finished(tokens, prompt_len)
        self.model.finished(tokens, prompt_len)

    def profile(self) -> dict:
        out = {**self.timer.profile(), "steps_by_source": dict(self.sources), "model_calls": self.model_calls,
               "model_catch_ups": self.catch_ups}
        ratio = self.clock.ratio()
        if ratio is not None:
            out["model_step_cost"] = round(ratio, 3)  # a step it drafted, in plain steps (wall time)
        gate = self.model.profile().get("gate")
        if gate:
            out["gate"] = gate
        lookup = self.lookup.profile().get("steps_by_source")
        return {**out, "lookup_steps_by_source": lookup} if lookup else out

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        self.timer.stop()
        if self._model_chose and not self._model_nodes:  # called, it drafted nothing: a step that earned nothing
            self.model_acceptance.update(0, 1)
        if self._model_nodes:  # the model drafted this step's chain: it and the hybrid learn its acceptance
            self.model.accepted(nodes, tree)
            self.model_acceptance.update(len(nodes) - 1, self._model_nodes)
        if self._merged:  # the model's chain, had it been drafted alone, was accepted as far as it agrees
            path, taken = self._model_path, tree.tokens[nodes[1:]].tolist()
            agree = next((i for i, (a, b) in enumerate(zip(path, taken)) if a != b), min(len(path), len(taken)))
            self.model_acceptance.update(agree, max(len(path), 1))
        if self._lookup_nodes:  # lookup learns from the accepted nodes that were its own (nodes 1..m)
            # Unmerged, every node is lookup's. Merged, the model's nodes come after lookup's (their parents
            # first), so a path's own nodes are its prefix up to the first past m.
            own = nodes[: 1 + int(np.sum(nodes[1:] <= self._lookup_nodes))] if self._merged else nodes
            self.lookup.accepted(own, tree)


class NoFreeSource(PromptLookupDrafter):
    """No free source: each step it proposes is a plain step, worth a plain step's 1.0 expected token
    per unit of cost (what a trained draft alone has to beat)."""

    kind = "plain"

    def propose(self, ctx: DraftContext) -> DraftTree:
        self._last = None
        return DraftTree.root(int(ctx.tokens[-1])).priced(self.worth(None, 0, 1))

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        pass


class PaidDraft(HybridDrafter):
    """An explicit trained draft behind the hybrid's rule: it drafts only where its expected tokens per
    unit of cost, its own call included, beat a plain step's (retried now and then), so it never makes
    decoding slower than plain. Its estimates outlive a generation, as ``auto``'s do."""

    keep_estimates = True

    def __init__(self, model: Drafter, chains: bool = False):
        super().__init__(model, lookup=NoFreeSource(), chains=chains)
        self.kind = model.kind
        self.sources = {"model": 0, "plain": 0}  # with no free source, nothing is drafted by lookup


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
