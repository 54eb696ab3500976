"""The decode loop: prefill, then draft -> verify -> accept -> commit, streaming tokens.

Plain autoregressive decoding is the same loop with a tree of one node (the root), so speculative
and plain decoding share every line that touches the cache and the logits: the only difference is
how many nodes a step carries. And one generation is the same loop as many: :meth:`Decoder.step` takes
B generations, each with its root and draft rows (laid out by :mod:`.rows`), runs them as one backend
step and accepts, commits and emits each by the same rule. ``generate`` is B = 1; the batch scheduler
(:mod:`.batch`) only admits, evicts and cancels around the same step.

    prefill -> while not done: tree_b = drafter_b.propose(ctx_b) -> out = backend.step(rows of every b)
            -> acc_b = accept_step(tree_b, out[b]) -> cache.commit_row(b, acc_b) -> emit(b)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial

import numpy as np

from .backends.base import Backend, StepInputs, StepOutputs
from .bundle import BundleManifest
from .cost_meter import StepCostMeter
from .drafters.base import DraftContext, Drafter
from .errors import DraftMismatchError, PromptError, TreeSpecError
from .generation import DecodeState, DecodeStats, Generation, GenerationConfig, SamplingParams
from .kvcache import KVCache, bucket_for, capacity_buckets
from .logprobs import token_logprobs
from .plan import StepPlan
from .rows import LoadGate, SeqRows, lone_step, rows_per_sequence, step_inputs
from .tree import DraftTree, TreeBuffers
from .tree_cost import step_cost
from .verify import Acceptance, greedy_accept, sample_accept, seeded_accept, typical_accept

# a generation's config, stats and state live in .generation; the runtime imports them from here too
__all__ = ["DecodeState", "DecodeStats", "Decoder", "Generation", "GenerationConfig", "SamplingParams", "accept_step",
           "cut_at_stop"]

class Decoder:
    """Runs generations against one backend, optionally with a drafter (the one ``generate`` uses).

    :meth:`step` is the one decode step of the runtime: B generations (``generate``: one; the batch
    scheduler: every active request) each bring their root and draft rows, one ``backend.step`` verifies
    them all, and each accepts, commits and emits by the same rule."""

    def __init__(self, backend: Backend, manifest: BundleManifest, drafter: Drafter | None = None,
                 max_tree: int | None = None, *, plan: StepPlan):
        self.backend = backend
        self.manifest = manifest
        # The step plan (runtime/plan.py), measured on this machine (probe.resolve_plan): which graph serves
        # 1-row steps, the fewest rows a step runs (dummy rows after the real ones), chains or trees, whether
        # speculation is exact and whether rows of several sequences are. Plain decoding follows the same plan,
        # so a speculative run and a plain run compute every emitted token's row the same way.
        self.plan = plan
        backend.use_split(self.plan.split)
        backend.use_gathered(self.plan.candidate.gathered)
        self.drafter = drafter if self.plan.speculate else None
        limit = manifest.limits.max_tree
        self.max_tree = min(max_tree or limit, limit, self.plan.max_rows)
        if self.max_tree < 1:
            raise TreeSpecError(f"The tree budget must be at least 1 node; got {self.max_tree}.")
        if drafter is not None:
            self.check_drafter(drafter)
        self.limit = manifest.limits.max_context
        self.buckets = capacity_buckets(self.limit, limit)
        self.eos = frozenset(manifest.model.eos_token_ids)
        self._neg = np.finfo(backend.mask_dtype).min
        self.chains_only = not self.plan.trees
        self.min_rows = self.plan.min_rows
        # Re-estimates the drafters' cost curve from the loop's step times (see track_costs).
        self.cost_meter: StepCostMeter | None = None
        self.load_gate = LoadGate()  # whether several sequences draft at all, by measured rates
        self.lone_steps = 0  # steps of several sequences where one ran alone (:func:`~.rows.lone_step`)

    def check_drafter(self, drafter: Drafter) -> None:
        """One sentence if ``drafter`` does not fit the bundle or reads base layers this backend does not return."""
        drafter.check(self.manifest)
        if drafter.feature_layers and not self.backend.layer_states:
            raise DraftMismatchError(f"The {drafter.kind} draft reads base layers {list(drafter.feature_layers)}, "
                                     f"which the {self.backend.name} backend does not return.")

    def track_costs(self, prior: Mapping[int, float]) -> None:
        """Size drafts on ``prior`` (the curve measured at load) and from then on on the curve the decode
        loop's own step times give (:class:`~.cost_meter.StepCostMeter`), kept across generations: a step of
        one generation by its nodes, a step of several by its rows in all."""
        if self.drafter is not None:
            self.drafter.use_cost_curve(prior)
        self.cost_meter = StepCostMeter(prior)

    @property
    def cost_curve(self) -> Mapping[int, float] | None:
        return None if self.cost_meter is None else self.cost_meter.curve

    # --- stages -------------------------------------------------------------------------------
    def _inputs(self, tree_tokens: np.ndarray, depth: np.ndarray, mask: np.ndarray, cache: KVCache,
                logits_rows: np.ndarray) -> StepInputs:
        """Place ``N`` nodes at slots ``length..length+N`` and positions ``length + depth`` (prefills)."""
        p, n, c = cache.length, len(tree_tokens), cache.capacity
        attn = np.full((1, 1, n, c), self._neg, dtype=self.backend.mask_dtype)  # [B, 1, N, C]
        attn[..., :p] = 0.0
        attn[0, 0, :, p : p + n] = np.where(mask, 0.0, self._neg)
        return StepInputs(
            input_ids=tree_tokens.reshape(1, n).astype(np.int64),
            position_ids=(p + depth).reshape(1, n).astype(np.int64),
            attention_mask=attn,
            write_indices=np.arange(p, p + n, dtype=np.int64),
            logits_index=logits_rows.astype(np.int64),
        )

    def prefill(self, prompt: list[int]) -> tuple[DecodeState, StepOutputs]:
        n = len(prompt)
        cache = self.backend.new_cache(1, bucket_for(min(n + self.max_tree, self.buckets[-1]), self.buckets))
        rows = max(n, self.min_rows)  # a 1-token prompt gets a dummy row after it (overwritten later)
        tokens = np.asarray(list(prompt) + [prompt[-1]] * (rows - n), dtype=np.int64)
        causal = np.tril(np.ones((rows, rows), dtype=bool))
        logits_rows = np.full(max(1, self.min_rows), n - 1)  # the lm_head too runs >= min_rows rows
        out = self.backend.step(self._inputs(tokens, np.arange(rows), causal, cache, logits_rows), cache)
        out = out.first(1, n)
        cache.length = n
        layers = None if out.layer_states is None else out.layer_states[0]
        state = DecodeState(cache, list(prompt), out.hidden_states[0], out.logits[0, -1], layers)
        return state, out

    def start(self, gen: Generation, state: DecodeState, out: StepOutputs) -> str | None:
        """``gen`` prefilled (``state``, ``out``: :meth:`prefill`'s): its first token accepted and emitted, its
        drafter reset; the finish reason if that token ended it."""
        if gen.drafter is not None:
            gen.drafter.reset()
        root = DraftTree.root(gen.tokens[-1])
        logits, argmax = self._rows(gen, root, out.logits[0], None if out.argmax is None else out.argmax[0])
        first = accept_step(root, root.buffers(), logits, argmax, gen.sampling, gen.rng, len(gen.tokens))
        gen.committed = len(gen.tokens)
        gen.hidden, gen.root_logits, gen.layers = state.hidden, state.root_logits, state.layers
        reason = self.emit(gen, [int(first.tokens[-1])])
        if gen.constraint is not None:
            gen.constraint.advance(gen.emitted)
        if gen.top_logprobs is not None:
            gen.stats.logprobs += token_logprobs(out.logits[0][:1], gen.emitted, gen.top_logprobs)
        return reason

    def propose(self, state: DecodeState | Generation, budget: int, stats: DecodeStats | None = None,
                drafter: Drafter | None = None, sequences: int = 1) -> DraftTree:
        """The draft of ``state``'s drafter (``drafter``; the decoder's own if None), at most ``budget`` nodes, for a
        step that ``sequences`` share."""
        drafter = drafter if drafter is not None else self.drafter
        if drafter is None or budget <= 1:
            return DraftTree.root(state.tokens[-1])
        ctx = DraftContext(np.asarray(state.tokens, dtype=np.int64), state.hidden, state.root_logits, budget,
                           state.layers, sequences)
        if not drafter.wants_draft(ctx):  # the gate: a hard step runs as plain decoding
            if stats is not None:
                stats.gate_ar += 1
            return DraftTree.root(state.tokens[-1])
        tree = drafter.propose(ctx)
        if stats is not None:  # a drafter that proposes nothing (its rule declined) ran a plain step too
            if tree.num_nodes == 1:
                stats.gate_ar += 1
            else:
                stats.gate_parallel += 1
        if len(tree.tokens) > budget or int(tree.tokens[0]) != state.tokens[-1]:
            raise TreeSpecError(
                f"The {drafter.kind} drafter proposed {len(tree.tokens)} nodes (budget {budget}) "
                "or a tree whose root is not the last token."
            )
        return tree.main_path() if self.chains_only else tree

    def verify(self, state: DecodeState, tree: DraftTree, buffers: TreeBuffers | None = None) -> StepOutputs:
        """One sequence's ``tree`` run on its own (probes and tools): its rows as :meth:`step` runs them."""
        n = len(tree.tokens)
        rows = max(n, self.min_rows)  # dummy nodes, a chain under the last node, their rows dropped
        cache = state.cache
        cache.ensure_capacity(cache.length + max(rows, 2), self.buckets)
        out = self.backend.step(step_inputs([SeqRows(cache.length, tree)], rows, cache.capacity,
                                            self.backend.mask_dtype), cache)
        return out.first(n, n) if rows > n else out

    def accept(self, tree: DraftTree, buffers: TreeBuffers, out: StepOutputs, sampling: SamplingParams,
               rng: np.random.Generator, position: int) -> Acceptance:
        """``position``: the index (in prompt + output) of the token after the tree's root."""
        return accept_step(tree, buffers, out.logits[0], None if out.argmax is None else out.argmax[0], sampling,
                           rng, position)

    def emit(self, gen: Generation, tokens: list[int]) -> str | None:
        """``gen``'s accepted ``tokens``, cut at EOS and its budget, appended to it and counted; the finish
        reason once it is done (``stop``: EOS; ``length``: its budget or the bundle's context)."""
        tokens = cut_at_stop(tokens, self.eos, gen.remaining)
        gen.tokens.extend(tokens)
        gen.remaining -= len(tokens)
        gen.emitted = tokens
        st = gen.stats
        st.new_tokens += len(tokens)
        if gen.t_decode:
            st.decode_s = time.perf_counter() - gen.t_decode
        if tokens and tokens[-1] in self.eos:
            return "stop"
        if gen.remaining <= 0 or len(gen.tokens) >= self.limit:
            return "length"
        return None

    # --- the step -------------------------------------------------------------------------------
    def step(self, gens: list[Generation], cache_for: Callable[..., KVCache]) -> list[str | None]:
        """One decode step of ``gens``: each proposes, one ``backend.step`` verifies every row, each accepts,
        commits and emits (its ``emitted`` tokens). Returns each one's finish reason or None.

        ``cache_for(columns)``: the cache whose first ``len(gens)`` rows are ``gens``' (row ``b``: its tokens at
        columns ``0..committed``), grown to hold ``columns``; ``cache_for(columns, b)``: row ``b`` alone. Each
        sequence brings at most ``max_tree`` nodes: a tree where the plan verifies trees and it is alone, else a chain.

        Alone, a generation's draft is sized by its drafter on the cost curve. With others, each one's draft is cut
        to its main path (a chain), and the rows per sequence ``T`` are the ones with the most expected tokens of the
        whole step per unit of the measured cost of ``B x T`` rows (:func:`~.rows.rows_per_sequence`): a draft row is
        spent only where it returns more than it costs the others. Where one sequence's draft verified alone returns
        more per unit of cost than that, it runs alone and the others keep their drafts for the next step
        (:func:`~.rows.lone_step`; emitting nothing this one)."""
        b = len(gens)
        t0 = time.perf_counter()
        drafting = b == 1 or self.load_gate.drafting(b)  # several: whether drafting pays at this load
        for gen in gens:
            if gen.held:  # it sat the last step out: its draft stands (dropped in a plain step; its drafter was asked)
                gen.held = False
                if not drafting:
                    gen.tree, gen.whole, gen.certain = DraftTree.root(gen.tokens[-1]), False, 0
                continue
            budget = min(self.max_tree, self.limit - len(gen.tokens), gen.remaining)
            # A step the gate runs plain asks only a drafter's recall of text met before (the suffix cache).
            asker = None if gen.drafter is None or budget <= 1 else gen.drafter if drafting else gen.drafter.recall()
            gen.asked = asker is not None and asker is gen.drafter
            # Who hears the verdict: whoever proposed, and no one where no one was asked (a drafter told of a plain
            # step it did not propose would count its last draft as rejected again).
            gen.proposer = asker
            if gen.asked and gen.unseen:  # the states of the steps it sat out, then the last one's
                gen.hidden = np.concatenate([h for h, _ in gen.unseen] + [gen.hidden])
                if gen.layers is not None:
                    gen.layers = np.concatenate([lay for _, lay in gen.unseen] + [gen.layers])
                gen.unseen.clear()
            tree = self.propose(gen, budget, gen.stats, asker, b) if asker else DraftTree.root(gen.tokens[-1])
            gen.source = asker.source if asker and tree.num_nodes > 1 else ""
            gen.stats.gate_ar += asker is None and gen.drafter is not None  # a plain step of a drafting generation
            gen.tree, gen.whole, gen.cut = (tree if b == 1 else tree.main_path()), True, False
            gen.certain = 0
            if gen.constraint is not None and gen.drafter is not None:  # plain decoding drafts nothing, forced or not
                draft, gen.certain = gen.constraint.draft(gen.tree, budget)
                if draft is not gen.tree:  # its drafter hears nothing of this step
                    gen.tree, gen.whole = draft, False
        lone = None  # (the sequence that runs alone, its rows)
        if b > 1 and any(g.tree.num_nodes > 1 for g in gens):
            curve = self.cost_curve or {1: 1.0}
            expected = [[g.expected(j) for j in range(g.tree.num_nodes)] for g in gens]
            cost = partial(step_cost, curve)  # a step of that many rows in all
            best = rows_per_sequence(expected, cost, self.min_rows)
            lone = lone_step(expected, cost, self.min_rows, best, [g.waited for g in gens])
            for i, gen in enumerate(gens):
                keep = best if lone is None else lone[1] if i == lone[0] else gen.tree.num_nodes
                if gen.tree.num_nodes > keep:  # its drafter hears of the verdict only on a draft verified whole
                    gen.cut = gen.whole  # its own proposal, cut: it may judge it by what the step emits
                    gen.tree, gen.whole = DraftTree.chain(gen.tree.tokens[:keep].tolist()), False
        stepped = gens if lone is None else [gens[lone[0]]]
        for gen in gens:
            gen.held = lone is not None and gen is not stepped[0]
            gen.waited = gen.waited + 1 if gen.held else 0
            if gen.held:
                gen.emitted = []
        t = max(g.tree.num_nodes for g in stepped)
        rows = max(t, self.min_rows)
        # >= 2 columns: a graph that pads a 1-row step's attention writes a dummy K/V to the next column.
        columns = max(g.committed for g in stepped) + max(rows, 2)
        cache = cache_for(columns) if lone is None else cache_for(columns, lone[0])
        inputs = step_inputs([SeqRows(g.committed, g.tree) for g in stepped], rows, cache.capacity,
                             self.backend.mask_dtype)
        tb = time.perf_counter()
        out = self.backend.step(inputs, cache)
        took = time.perf_counter() - tb
        # A lone step by its nodes (the curve its drafter sizes on, measured with its padding), several by
        # their rows in all.
        if self.cost_meter is not None and self.cost_meter.add(t if len(stepped) == 1 else b * rows, took):
            for gen in gens:
                if gen.drafter is not None:
                    gen.drafter.use_cost_curve(self.cost_meter.curve)  # the loop's own step costs (cost_meter.py)
        if lone is not None:
            reasons: list[str | None] = [None] * b
            reasons[lone[0]] = self._advance(0, stepped[0], cache, out, took)
            self.lone_steps += 1
        else:
            reasons = [self._advance(r, gen, cache, out, took) for r, gen in enumerate(gens)]
        if b > 1:
            self.load_gate.record(b, drafting, sum(len(g.emitted) for g in gens), time.perf_counter() - t0)
        return reasons

    @staticmethod
    def _rows(gen: Generation, tree: DraftTree, logits: np.ndarray, argmax: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """``tree``'s rows as acceptance sees them: a constrained generation's masked by its grammar, row by row
        along its chain (a backend's argmax, of the unmasked rows, is then not used)."""
        if gen.constraint is None:
            return logits, argmax
        return gen.constraint.mask(tree.tokens.tolist(), logits, None if tree.is_chain else tree.parents), None

    def _advance(self, r: int, gen: Generation, cache: KVCache, out: StepOutputs, took: float) -> str | None:
        """Row ``r``'s acceptance (the loop's one rule), its accepted nodes' K/V kept, its tokens emitted."""
        tree = gen.tree
        n = tree.num_nodes
        buffers = tree.buffers()
        logits, argmax = self._rows(gen, tree, out.logits[r, :n], None if out.argmax is None else out.argmax[r, :n])
        acc = accept_step(tree, buffers, logits, argmax, gen.sampling, gen.rng, len(gen.tokens))
        nodes = acc.nodes
        last = int(nodes[-1])
        cache.commit_row(r, gen.committed, nodes)
        if n - 1 > gen.certain:  # the draft's own tokens, past the forced ones
            gen.acceptance.update(max(0, len(nodes) - 1 - gen.certain), n - 1 - gen.certain)
        if gen.proposer is not None and gen.whole:  # a trimmed draft's cut tokens were never tried
            gen.proposer.accepted(nodes, tree)
        # Nodes 0..last (a chain's accepted prefix, always) as a slice: one small numpy call fewer than
        # fancy indexing (see verify._chain_accept); copied either way (the backend reuses its outputs).
        keep = slice(0, last + 1) if last == len(nodes) - 1 else nodes
        gen.committed += len(nodes)
        if not gen.asked and gen.drafter is not None:  # kept for its drafter's next call (a model catches up)
            gen.unseen.append((gen.hidden, gen.layers))
        gen.hidden = out.hidden_states[r, keep].copy()
        if out.layer_states is not None:
            gen.layers = out.layer_states[r, keep].copy()
        gen.root_logits = out.logits[r, last]
        st = gen.stats
        st.steps += 1
        st.backend_s += took
        st.tree_sizes.append(n)
        reason = self.emit(gen, acc.tokens.tolist())
        if gen.cut and gen.proposer is not None:
            gen.proposer.observed(gen.emitted)
        st.accepted.append(len(gen.emitted))
        if gen.constraint is not None:
            gen.constraint.advance(gen.emitted)
        if gen.top_logprobs is not None:  # token i was chosen by the row of accepted node i
            st.logprobs += token_logprobs(out.logits[r, nodes[: len(gen.emitted)]], gen.emitted, gen.top_logprobs)
        return reason

    # --- one generation ---------------------------------------------------------------------------
    def check_prompt(self, prompt: list[int], config: GenerationConfig) -> None:
        if not prompt:
            raise PromptError("The prompt is empty.")
        if len(prompt) >= self.limit:
            raise PromptError(
                f"The prompt has {len(prompt)} tokens but the bundle's maximum context is {self.limit} tokens."
            )

    def generate(self, prompt: list[int], config: GenerationConfig, stats: DecodeStats | None = None
                 ) -> Iterator[int]:
        """Yield new token ids (EOS included when reached) until EOS, max tokens or the context limit: a batch of
        one generation through :meth:`step`."""
        self.check_prompt(prompt, config)
        stats = stats if stats is not None else DecodeStats()
        sampling = config.sampling
        stats.prompt_tokens = len(prompt)
        stats.lossy = (sampling.typical and not sampling.greedy) or (self.drafter is not None and self.plan.lossy)
        gen = Generation(prompt, config, stats, self.drafter)
        t0 = time.perf_counter()
        state, out = self.prefill(prompt)
        cache = state.cache
        try:
            reason = self.start(gen, state, out)
            stats.prefill_s = time.perf_counter() - t0
            yield from gen.emitted
            gen.t_decode = time.perf_counter()

            def cache_for(columns: int) -> KVCache:
                cache.length = gen.committed
                cache.ensure_capacity(columns, self.buckets)
                return cache

            while reason is None:
                (reason,) = self.step([gen], cache_for)
                yield from gen.emitted
            stats.finish_reason = reason
        finally:
            if self.drafter is not None:  # however the generation ended (a consumer may stop early)
                self.drafter.finished(gen.tokens, len(prompt))


def accept_step(tree: DraftTree, buffers: TreeBuffers, logits: np.ndarray, argmax: np.ndarray | None,
                sampling: SamplingParams, rng: np.random.Generator, position: int) -> Acceptance:
    """The decode loop's one acceptance rule, for a sequence's ``N`` rows of ``logits`` ``[N, V]`` (``argmax``
    ``[N]`` where the backend gave it): greedy, Medusa's typical acceptance (lossy, opt-in), seeded sampling
    (reproducible whatever was drafted) or tree rejection sampling. ``position``: the index (in prompt + output)
    of the token after the tree's root."""
    if sampling.greedy:
        return greedy_accept(tree, buffers, logits, argmax)
    if sampling.typical:
        return typical_accept(tree, buffers, logits, sampling.temperature, sampling.typical_rule, rng)
    if sampling.seed is not None:  # reproducible whatever the drafter proposed (its state spans requests)
        return seeded_accept(tree, buffers, logits, sampling.seed, position, sampling.temperature,
                             sampling.top_p, sampling.top_k)
    return sample_accept(tree, buffers, logits, rng, sampling.temperature, sampling.top_p, sampling.top_k)


def cut_at_stop(emitted: list[int], eos: frozenset[int], remaining: int) -> list[int]:
    """The accepted tokens up to and including the first end-of-sequence token, and at most ``remaining``."""
    cut = len(emitted)
    for i, tok in enumerate(emitted):
        if tok in eos:
            cut = i + 1
            break
    return emitted[: min(cut, remaining)]
