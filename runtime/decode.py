"""The decode loop: prefill, then draft -> verify -> accept -> commit, streaming tokens.

Plain autoregressive decoding is the same loop with a tree of one node (the root), so speculative
and plain decoding share every line that touches the cache and the logits: the only difference is
how many nodes a step carries. Each stage is a named function with explicit inputs and outputs.

    prefill -> while not done: tree = drafter.propose(ctx) -> out = backend.step(tree)
            -> acc = accept(tree, out) -> cache.commit(acc) -> yield tokens
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from .backends.base import Backend, StepInputs, StepOutputs
from .bundle import BundleManifest
from .cost_meter import StepCostMeter
from .drafters.base import DraftContext, Drafter
from .errors import DraftMismatchError, PromptError, TreeSpecError
from .kvcache import KVCache, bucket_for, capacity_buckets
from .plan import StepPlan
from .tree import DraftTree, TreeBuffers
from .verify import Acceptance, TypicalRule, greedy_accept, sample_accept, seeded_accept, typical_accept


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. ``typical`` switches to Medusa's typical acceptance: LOSSY, opt-in."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    typical: bool = False
    typical_rule: TypicalRule = field(default_factory=TypicalRule)

    def __post_init__(self) -> None:
        if self.temperature < 0 or not np.isfinite(self.temperature):
            raise PromptError("temperature must be a finite number >= 0.")
        if not (0.0 < self.top_p <= 1.0):
            raise PromptError("top_p must be in (0, 1].")
        if self.top_k < 0:
            raise PromptError("top_k must be >= 0.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise PromptError("max_new_tokens must be at least 1.")


@dataclass
class DecodeStats:
    """Filled in while a generation runs; read it after the iterator is exhausted."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target forward passes after prefill
    prefill_s: float = 0.0
    decode_s: float = 0.0
    backend_s: float = 0.0  # time inside backend.step during decode
    accepted: list[int] = field(default_factory=list)  # tokens emitted per decode step
    tree_sizes: list[int] = field(default_factory=list)
    finish_reason: str = ""
    lossy: bool = False
    gate_parallel: int = 0  # steps the drafter's gate sent to draft + tree verify
    gate_ar: int = 0  # steps the gate ran as plain T=1 decoding (no draft cost)

    @property
    def mean_accepted(self) -> float:
        """tau: tokens emitted per target forward pass (the prefill's first token counts for the prefill)."""
        return float(np.mean(self.accepted)) if self.accepted else 1.0

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.new_tokens - 1  # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    @property
    def loop_overhead(self) -> float:
        """Fraction of decode time spent in the Python loop outside the backend."""
        return 1.0 - self.backend_s / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class DecodeState:
    """Everything that changes from step to step, passed explicitly between the stages."""

    cache: KVCache
    tokens: list[int]  # prompt + emitted; tokens[-1] is the root, whose K/V is not in the cache yet
    hidden: np.ndarray  # [A, H] base hidden states of the last accepted nodes
    root_logits: np.ndarray  # [V] logits that produced the root
    layers: np.ndarray | None = None  # [A, taps*H] their tapped layer states (graphs with feature_layers)


class Decoder:
    """Runs generations against one backend, optionally with a drafter."""

    def __init__(self, backend: Backend, manifest: BundleManifest, drafter: Drafter | None = None,
                 max_tree: int | None = None, *, plan: StepPlan):
        self.backend = backend
        self.manifest = manifest
        # The step plan (runtime/plan.py), measured on this machine (probe.resolve_plan): which graph serves
        # 1-row steps, the fewest rows a step runs (dummy rows after the real ones), chains or trees, and
        # whether speculation is exact. Plain decoding follows the same plan, so a speculative run and a
        # plain run compute every emitted token's row the same way.
        self.plan = plan
        backend.use_split(self.plan.split)
        backend.use_gathered(self.plan.candidate.gathered)
        self.drafter = drafter if self.plan.speculate else None
        limit = manifest.limits.max_tree
        self.max_tree = min(max_tree or limit, limit, self.plan.max_rows)
        if self.max_tree < 1:
            raise TreeSpecError(f"The tree budget must be at least 1 node; got {self.max_tree}.")
        if drafter is not None:
            drafter.check(manifest)
            if drafter.feature_layers and not backend.layer_states:
                raise DraftMismatchError(f"The {drafter.kind} draft reads base layers {list(drafter.feature_layers)}, "
                                         f"which the {backend.name} backend does not return.")
        self.buckets = capacity_buckets(manifest.limits.max_context, limit)
        self.eos = frozenset(manifest.model.eos_token_ids)
        self._neg = np.finfo(backend.mask_dtype).min
        self.chains_only = not self.plan.trees
        self.min_rows = self.plan.min_rows
        # Re-estimates the drafter's cost curve from the loop's step times (see track_costs).
        self.cost_meter: StepCostMeter | None = None

    def track_costs(self, prior: Mapping[int, float]) -> None:
        """Give the drafter ``prior`` (the curve measured at load) and from then on the curve the decode
        loop's own step times give (:class:`~.cost_meter.StepCostMeter`), kept across generations."""
        if self.drafter is None:
            raise ValueError("Only a decoder with a drafter has a cost curve to track.")
        self.drafter.use_cost_curve(prior)
        self.cost_meter = StepCostMeter(prior)

    # --- stages -------------------------------------------------------------------------------
    def _inputs(self, tree_tokens: np.ndarray, depth: np.ndarray, mask: np.ndarray, cache: KVCache,
                logits_rows: np.ndarray) -> StepInputs:
        """Place ``N`` nodes at slots ``length..length+N`` and positions ``length + depth``."""
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

    def propose(self, state: DecodeState, budget: int, stats: DecodeStats | None = None) -> DraftTree:
        if self.drafter is None or budget <= 1:
            return DraftTree.root(state.tokens[-1])
        ctx = DraftContext(np.asarray(state.tokens, dtype=np.int64), state.hidden, state.root_logits, budget,
                           state.layers)
        if not self.drafter.wants_draft(ctx):  # the gate: a hard step runs as plain decoding
            if stats is not None:
                stats.gate_ar += 1
            return DraftTree.root(state.tokens[-1])
        tree = self.drafter.propose(ctx)
        if stats is not None:  # a drafter that proposes nothing (its rule declined) ran a plain step too
            if tree.num_nodes == 1:
                stats.gate_ar += 1
            else:
                stats.gate_parallel += 1
        if len(tree.tokens) > budget or int(tree.tokens[0]) != state.tokens[-1]:
            raise TreeSpecError(
                f"The {self.drafter.kind} drafter proposed {len(tree.tokens)} nodes (budget {budget}) "
                "or a tree whose root is not the last token."
            )
        return tree.main_path() if self.chains_only else tree

    def verify(self, state: DecodeState, tree: DraftTree, buffers: TreeBuffers) -> StepOutputs:
        n = len(tree.tokens)
        if n < self.min_rows:  # dummy nodes, a chain under the last node, their rows dropped
            tokens = np.concatenate([tree.tokens, np.repeat(tree.tokens[-1:], self.min_rows - n)])
            padded = DraftTree(tokens, np.concatenate([tree.parents, np.arange(n - 1, self.min_rows - 1)]))
            out = self._step(state, padded, padded.buffers())  # cached by shape
            return out.first(n, n)
        return self._step(state, tree, buffers)

    def _step(self, state: DecodeState, tree: DraftTree, buffers: TreeBuffers) -> StepOutputs:
        n = len(tree.tokens)
        # >= 2 slots: a graph that pads a 1-row step's attention writes a dummy K/V to the next slot.
        state.cache.ensure_capacity(state.cache.length + max(n, 2), self.buckets)
        inputs = self._inputs(tree.tokens, buffers.depth, buffers.mask, state.cache, np.arange(n))
        return self.backend.step(inputs, state.cache)

    def accept(self, tree: DraftTree, buffers: TreeBuffers, out: StepOutputs, sampling: SamplingParams,
               rng: np.random.Generator, position: int) -> Acceptance:
        """``position``: the index (in prompt + output) of the token after the tree's root."""
        return accept_step(tree, buffers, out.logits[0], None if out.argmax is None else out.argmax[0], sampling,
                           rng, position)

    def commit(self, state: DecodeState, tree: DraftTree, acc: Acceptance, out: StepOutputs) -> list[int]:
        """Keep the accepted nodes' K/V and hidden states; the bonus token becomes the next root."""
        nodes = acc.nodes
        last = int(nodes[-1])
        state.cache.commit(state.cache.length + nodes)
        if self.drafter is not None:
            self.drafter.accepted(nodes, tree)
        # Nodes 0..last (a chain's accepted prefix, always) as a slice: one small numpy call fewer than
        # fancy indexing (see verify._chain_accept); copied either way.
        rows = slice(0, last + 1) if last == len(nodes) - 1 else nodes
        state.hidden = out.hidden_states[0, rows].copy()
        if out.layer_states is not None:
            state.layers = out.layer_states[0, rows].copy()
        state.root_logits = out.logits[0, last]
        emitted = acc.tokens.tolist()
        state.tokens.extend(emitted)
        return emitted

    # --- the loop ---------------------------------------------------------------------------------
    def check_prompt(self, prompt: list[int], config: GenerationConfig) -> None:
        limit = self.manifest.limits.max_context
        if not prompt:
            raise PromptError("The prompt is empty.")
        if len(prompt) >= limit:
            raise PromptError(
                f"The prompt has {len(prompt)} tokens but the bundle's maximum context is {limit} tokens."
            )

    def generate(self, prompt: list[int], config: GenerationConfig, stats: DecodeStats | None = None
                 ) -> Iterator[int]:
        """Yield new token ids (EOS included when reached) until EOS, max tokens or the context limit."""
        self.check_prompt(prompt, config)
        stats = stats if stats is not None else DecodeStats()
        sampling = config.sampling
        stats.prompt_tokens = len(prompt)
        stats.lossy = (sampling.typical and not sampling.greedy) or (self.drafter is not None and self.plan.lossy)
        rng = np.random.default_rng(sampling.seed)
        if self.drafter is not None:
            self.drafter.reset()

        t0 = time.perf_counter()
        state, out = self.prefill(prompt)
        try:
            root_tree = DraftTree.root(prompt[-1])
            first = self.accept(root_tree, root_tree.buffers(), out, sampling, rng, len(prompt))
            token = int(first.tokens[-1])
            state.tokens.append(token)
            stats.prefill_s = time.perf_counter() - t0
            stats.new_tokens = 1
            yield token
            if token in self.eos:
                stats.finish_reason = "stop"
                return
            yield from self._decode_loop(state, config, stats, rng)
        finally:
            if self.drafter is not None:  # however the generation ended (a consumer may stop early)
                self.drafter.finished(state.tokens[: len(prompt) + stats.new_tokens], len(prompt))

    def _decode_loop(self, state: DecodeState, config: GenerationConfig, stats: DecodeStats,
                     rng: np.random.Generator) -> Iterator[int]:
        sampling, limit = config.sampling, self.manifest.limits.max_context
        t_dec = time.perf_counter()
        remaining = config.max_new_tokens - 1
        while remaining > 0:
            # A step of n nodes fills n slots and emits up to n tokens, the last of which (the next
            # root) needs no slot yet but counts towards the context: n <= room - 1 keeps prompt +
            # generated tokens within the limit, as plain decoding's 1-node steps do.
            room = limit - state.cache.length
            if room <= 1:
                stats.finish_reason = "length"
                break
            tree = self.propose(state, min(self.max_tree, room - 1) if self.drafter else 1, stats)
            buffers = tree.buffers()
            tb = time.perf_counter()
            out = self.verify(state, tree, buffers)
            took = time.perf_counter() - tb
            stats.backend_s += took
            if self.cost_meter is not None and self.cost_meter.add(len(tree.tokens), took):
                self.drafter.use_cost_curve(self.cost_meter.curve)  # the loop's own step costs (cost_meter.py)
            acc = self.accept(tree, buffers, out, sampling, rng, len(state.tokens))
            emitted = self.commit(state, tree, acc, out)
            stats.steps += 1
            stats.tree_sizes.append(len(tree.tokens))
            emitted = cut_at_stop(emitted, self.eos, remaining)
            stats.accepted.append(len(emitted))
            stats.new_tokens += len(emitted)
            remaining -= len(emitted)
            stats.decode_s = time.perf_counter() - t_dec
            yield from emitted
            if emitted and emitted[-1] in self.eos:
                stats.finish_reason = "stop"
                break
        else:
            stats.finish_reason = "length"
        stats.decode_s = time.perf_counter() - t_dec


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


def measure_cost_curve(decoder: Decoder, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32), repeats: int = 5,
                       past: int = 256) -> dict[int, float]:
    """Cost of a T-token step relative to a 1-token step, measured on ``decoder``'s backend.

    Each size runs ``repeats`` chain steps over a scratch cache holding ``past`` tokens (fewer when the
    bundle's context is short), in rounds over the sizes; each round gives every size's cost relative
    to that round's 1-token step, and the median over the rounds counts: a slow spell of the machine
    hits a ratio's two sides alike, and one lucky or unlucky step moves nothing. (Neither this nor the
    fastest run of each size, used before, makes the curve agree between the workers of one bench run:
    2 rows cost 1.07-1.30 of 1 row with the one, 1.12-1.30 with the other, on the AMD EPYC.)
    On a backend that runs 1-row and multi-row steps on different graphs (``OrtBackend`` with a
    GGUF-block graph) the curve has a step between T = 1 and T = 2, which a fixed table cannot know.
    """
    sizes = tuple(t for t in sizes if t <= decoder.max_tree) or (1,)
    past = max(1, min(past, decoder.manifest.limits.max_context - sizes[-1]))
    cache = decoder.backend.new_cache(1, bucket_for(min(past + sizes[-1], decoder.buckets[-1]), decoder.buckets))
    cache.length = past
    feeds = {}
    for size in sizes:
        t = max(size, decoder.min_rows)  # what a step of ``size`` nodes runs
        feeds[size] = decoder._inputs(np.zeros(t, dtype=np.int64), np.arange(t),
                                      np.tril(np.ones((t, t), dtype=bool)), cache, np.arange(t))
        decoder.backend.step(feeds[size], cache)  # warm-up (first run of this shape)
    ratios: dict[int, list[float]] = {t: [] for t in sizes}
    for _ in range(repeats):
        took = {}
        for size in sizes:
            t0 = time.perf_counter()
            decoder.backend.step(feeds[size], cache)
            took[size] = time.perf_counter() - t0
        for size in sizes:
            ratios[size].append(took[size] / took[sizes[0]])
    return without_spikes({t: float(np.median(ratios[t])) for t in sizes})


SPIKE = 1.15  # a point this far above the chord of its neighbours is a slow spell, not the kernels


def without_spikes(curve: dict[int, float]) -> dict[int, float]:
    """``curve`` with each point from T = 4 on that sits more than :data:`SPIKE` times above the chord of
    its neighbours brought down to that chord. A step's cost grows about linearly in its rows beyond a
    few, so such a point is the machine's noise; kept, it would stop every drafter from drafting that
    deep, and so from ever timing it again in the loop. (From T = 1 to 2 a real jump is possible: a
    backend may run 1-row steps on another graph.)"""
    sizes = sorted(curve)
    out = dict(curve)
    for lo, t, hi in zip(sizes, sizes[1:], sizes[2:]):
        if lo < 2:
            continue
        chord = out[lo] + (out[hi] - out[lo]) * (t - lo) / (hi - lo)
        if out[t] > SPIKE * chord:
            out[t] = chord
    return out

