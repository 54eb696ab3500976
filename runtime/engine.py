"""The embedding API: ``engine = load(bundle)``; ``engine.generate(...)`` and ``engine.stream(...)``.

    import os

    from specdeploy.runtime import load

    bundle = os.environ.get("SPECDEPLOY_BUNDLE", "bundles/smollm2")
    with load(bundle, draft="prompt-lookup") as engine:
        out = engine.generate("Name three prime numbers.", max_new_tokens=32, temperature=0.0)
        print(out.text)
        print(f"{out.stats.tokens_per_s:.1f} tok/s, tau {out.stats.mean_accepted:.2f}, {out.finish_reason}")
        chat = [{"role": "user", "content": "Write a haiku about CPUs."}]
        for delta in engine.stream(messages=chat, max_new_tokens=48, stop=["\\n\\n"]):
            print(delta, end="", flush=True)
        print()

(That snippet is ``tests/api_example.py``, which a test runs as it stands.)

One engine owns one backend session and is safe to share between threads. With ``max_batch=1`` (the
default) it has a single decode slot: concurrent callers queue for it in arrival order and each
generation runs start to finish on its own, never interleaved with another. With ``max_batch=N`` it
batches continuously (:mod:`.batch`): up to N generations share every decode step, joining and
leaving at step boundaries, and a greedy request's output is the one ``generate`` gives on the same
bundle (the step plan's probe checks a sequence's rows among others' bit for bit at load, :mod:`.rows`). Prompt encoding and validation happen before
queueing, in the caller's thread.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from .backends import make_backend
from .batch import BatchScheduler, drafter_factory
from .bundle import BundleManifest, read_manifest
from .cost_curve import measure_cost_curve
from .decode import Decoder, DecodeStats, GenerationConfig, SamplingParams
from .drafters import make_drafter
from .drafters.kinds import AUTO
from .errors import ExactnessWarning, PromptError, SpecDeployError
from .grammar import CompiledGrammar, Grammar, GrammarCompiler, GrammarError
from .plan import ROWS_CHECK, StepPlan
from .probe import resolve_plan
from .scheduler import Scheduler, SerialScheduler
from .streaming import Completion, TextStream, text_deltas
from .text import TextCodec
from .tools import ToolCallParser, ToolError, ToolSpec, call_grammar


def _rows_verdict(plan: StepPlan) -> str:
    """What the probe found of the rows of several sequences on ``plan``'s candidate, in a few words."""
    res = next((r for r in plan.probes if r.candidate == plan.candidate), None)
    rows = [c for c in (res.checks if res else ()) if c.what.startswith(ROWS_CHECK)]
    if not rows:
        return "not the gathered layout, the one that can take them"
    worst = max(rows, key=lambda c: c.max_abs)
    return f"a row differs by {worst.max_abs:.2g} in '{worst.what}'"


__all__ = ["Completion", "Engine", "EngineStats", "TextStream", "load"]


@dataclass(frozen=True)
class EngineStats:
    """Totals since the engine was loaded, plus the queue right now; from ``Engine.stats()``."""

    generations: int  # finished, stopped or cancelled after they got the slot
    cancelled: int  # closed before their end, whether queued or running
    prompt_tokens: int
    new_tokens: int
    steps: int  # decode steps (target forward passes after the prefills)
    step_tokens: int  # tokens emitted by those steps (the prefills' first tokens excluded)
    busy_s: float  # time the decode slot was held
    queue_depth: int  # callers waiting for the slot (or a batch row) now
    running: int  # generations decoding now (at most max_batch)
    last_tokens_per_s: float  # of the last generation that emitted a token
    last_tau: float

    @property
    def tau(self) -> float:
        """Mean tokens per decode step over every generation so far."""
        return self.step_tokens / self.steps if self.steps else 1.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of slot time (throughput while busy)."""
        return self.new_tokens / self.busy_s if self.busy_s > 0 else 0.0


class Engine:
    def __init__(self, bundle: str | Path, backend: str = "ort-cpu", draft: str | None = AUTO,
                 threads: int | None = None, tree: str | None = None, max_tree: int | None = None,
                 allow_inexact: bool = False, progress: Callable[[str], None] | None = None, max_batch: int = 1,
                 suffix_cache_tokens: int | None = None, step_plan: str | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise SpecDeployError(f"max_batch must be a whole number of at least 1; got {max_batch!r}.")
        self.bundle_dir = Path(bundle)
        self.manifest: BundleManifest = read_manifest(self.bundle_dir)
        self.codec = TextCodec.for_bundle(self.bundle_dir, self.manifest)
        self.backend = make_backend(backend, self.bundle_dir, self.manifest, threads=threads)
        # The step plan, measured on this machine (cached per CPU, ONNX Runtime version and bundle): plain
        # and speculative decoding both follow it, whether or not this engine drafts.
        self.plan: StepPlan = resolve_plan(self.backend, self.manifest, allow_inexact=allow_inexact,
                                           progress=progress, step_plan=step_plan)
        self.draft_name = draft or "none"
        if self.draft_name == AUTO and not self.plan.speculate:
            self.draft_name = "none"  # the default declines quietly: engine.plan says why
        elif self.draft_name != "none" and not self.plan.speculate:
            warnings.warn(f"The '{self.draft_name}' draft is not used: {self.plan.reason}", ExactnessWarning,
                          stacklevel=3)
            self.draft_name = "none"
        self.batch_reason = "one generation at a time (max_batch 1)."
        drafter = None
        scheduler = self._batching(max_batch, allow_inexact, suffix_cache_tokens, threads) if max_batch > 1 else None
        if scheduler is not None:
            self.scheduler: Scheduler = scheduler
        else:
            drafter = make_drafter(self.draft_name, self.bundle_dir, self.manifest, tree=tree, threads=threads,
                                   chains=not self.plan.trees, backend=self.backend,
                                   suffix_cache_tokens=suffix_cache_tokens)
            self.scheduler = SerialScheduler(Decoder(self.backend, self.manifest, drafter, max_tree=max_tree,
                                                     plan=self.plan))
        self.max_batch = self.scheduler.max_batch  # 1 where the batch probe turned batching off
        self.decoder = self.scheduler.decoder
        self.backend.release_unused()
        self.cost_curve: dict[int, float] | None = None  # measured when the drafter trades length for cost
        if drafter is not None and drafter.needs_cost_curve:
            # The drafter sizes its drafts by step cost: measure this backend's (~1 s).
            self.cost_curve = measure_cost_curve(self.decoder)
            self.decoder.track_costs(self.cost_curve)  # then re-estimated from the decode loop's steps
        self._mutex = threading.Lock()  # guards the totals below and the set of open streams
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request
        self._streams: weakref.WeakSet[TextStream] = weakref.WeakSet()
        self._totals = {"generations": 0, "cancelled": 0, "prompt_tokens": 0, "new_tokens": 0, "steps": 0,
                        "step_tokens": 0}
        self._last = (0.0, 1.0)  # tokens/s and tau of the last generation
        self._closed = False

    def _batching(self, max_batch: int, allow_inexact: bool, suffix_cache_tokens: int | None, threads: int | None
                  ) -> BatchScheduler | None:
        """The continuous-batching scheduler where the step plan computes a sequence's rows the same whatever else
        the step holds (``StepPlan.rows``), or labelled lossy with ``allow_inexact``; else None (one generation at
        a time, with speculation), with one warning that says why."""
        def factory():  # made only where it batches: the serial fallback makes its own drafter
            return drafter_factory(self.draft_name, self.bundle_dir, self.manifest, suffix_cache_tokens, threads,
                                   self.backend, chains=not self.plan.trees)

        if self.plan.rows and self.backend.can_batch_rows:
            self.batch_reason = (f"exact batching: up to {max_batch} requests share each step, each answer the one "
                                 f"it gets alone (step plan '{self.plan.candidate.name}', probed on this machine).")
            return BatchScheduler(self.backend, self.manifest, self.plan, max_batch, new_drafter=factory())
        why = ("no step plan here computes a sequence's rows the same among other sequences' rows "
               f"({self.plan.candidate.name}: {_rows_verdict(self.plan)})")
        if not allow_inexact or not self.backend.can_batch_rows:
            if not self.backend.can_batch_rows:
                why = ("the bundle's gathered graph predates rows of several sequences (re-export its base with this "
                       "specdeploy)" if self.backend.can_gather else
                       f"the {self.backend.name} backend has no graph that takes rows of several sequences")
            warnings.warn(f"Batching is off: {why}, so requests run one at a time, each exactly as alone; pass "
                          "allow_inexact to batch anyway, labelled lossy.", ExactnessWarning, stacklevel=4)
            self.batch_reason = f"one request at a time: {why}."
            return None
        # every step of a tree's size on the gathered graph, the one that takes rows of several sequences
        plan = dataclasses.replace(self.plan, candidate=dataclasses.replace(self.plan.candidate, gathered=True,
                                                                            split=False))
        self.batch_reason = f"LOSSY batching (allow_inexact): {why}; answers may differ from a request alone."
        return BatchScheduler(self.backend, self.manifest, plan, max_batch, new_drafter=factory(), lossy=True)

    @property
    def fingerprint(self) -> str:
        """What a response's ``system_fingerprint`` says: the step plan, and ``exact`` where every answer is the
        bundle's own at any load, else ``lossy`` (``allow_inexact``: speculation or batching may change it)."""
        lossy = self.plan.lossy or getattr(self.scheduler, "lossy", False)
        return f"specdeploy-{self.plan.candidate.name}-{'lossy' if lossy else 'exact'}"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_context(self) -> int:
        return self.manifest.limits.max_context

    # --- prompts ----------------------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
               chat: bool = False, tools: ToolSpec | None = None) -> list[int]:
        if (prompt is None) == (messages is None):
            raise PromptError("Give either a prompt or a messages list, not both.")
        if messages is not None:
            return self.codec.encode_chat(messages, tools)
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError("The prompt is empty.")
        if chat or tools is not None:
            return self.codec.encode_chat([{"role": "user", "content": prompt}], tools)
        return self.codec.encode(prompt)

    # --- generation -------------------------------------------------------------------------
    def stream(self, prompt: str | None = None, messages: Sequence[dict] | None = None, *,
               max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               stop: Sequence[str] = (), seed: int | None = None, chat: bool = False,
               typical: bool = False, cache_namespace: str = "", logprobs: int | None = None,
               response_format: dict | None = None, regex: str | None = None, grammar: str | None = None,
               tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
               parallel_tool_calls: bool | None = None) -> TextStream:
        """Stream text deltas. Validation happens here; the stream queues for the engine at its first ``next()``.
        ``cache_namespace``: the part of a cross-request draft cache (the suffix draft's) this generation reads
        and adds to; "" shares it with every generation that passes "" (the default). ``logprobs``: each token's
        log-probability and its position's ``logprobs`` most likely tokens (0-20) in ``completion.logprobs``
        (live in ``stats.logprobs``), bit for bit those of plain decoding where the step plan is exact.
        ``response_format`` (OpenAI's: ``json_object``, or ``json_schema`` with its schema), ``regex`` or ``grammar``
        (Lark) constrain the output, every draft source staying exact under the constraint (``runtime/grammar.py``);
        an invalid or unsupported one fails here in one sentence (:class:`~.grammar.GrammarError`).
        ``tools`` (OpenAI's function tools), ``tool_choice`` (``auto``, the default with tools; ``none``; ``required``;
        or ``{"type": "function", "function": {"name": ...}}``) and ``parallel_tool_calls`` as OpenAI's: the tools go
        through the chat template (a prompt becomes a user message), and ``completion.tool_calls`` holds the answer's
        calls; ``required`` and a named function constrain the answer to calls that parse (``runtime/tools.py``)."""
        if self._closed:
            raise SpecDeployError("This engine is closed.")
        if isinstance(stop, str):
            stop = (stop,)
        spec = ToolSpec.parse(tools, tool_choice, parallel_tool_calls)
        ids = self.encode(prompt, messages, chat, spec)
        constraint = self._constraint(response_format, regex, grammar)
        parser = None
        if spec is not None and spec.shown:
            fmt = self.codec.tool_call_format
            calls = self._compile(Grammar("lark", call_grammar(spec, fmt, self.codec.tool_tag_ids)), "tools")
            if spec.forced:
                if constraint is not None:
                    raise GrammarError("Give one constraint: response_format, regex, grammar or a required tool call.")
                constraint = calls
            parser = ToolCallParser(fmt, forced=spec.forced)
        config = GenerationConfig(max_new_tokens, SamplingParams(temperature, top_p, top_k, seed, typical), logprobs,
                                  constraint)
        self.decoder.check_prompt(ids, config)
        stops = tuple(s for s in stop if s)
        stream = TextStream(len(ids))
        stream.attach(self._run(ids, config, stops, stream, cache_namespace, parser))
        with self._mutex:
            self._streams.add(stream)
        return stream

    def _constraint(self, response_format: dict | None, regex: str | None, grammar: str | None
                    ) -> CompiledGrammar | None:
        """The one constraint asked for, compiled against this bundle's tokenizer (built at the first one)."""
        asked = [g for g in (Grammar.from_response_format(response_format),
                             None if regex is None else Grammar("regex", regex),
                             None if grammar is None else Grammar("lark", grammar)) if g is not None]
        if not asked:
            return None
        if len(asked) > 1:
            raise GrammarError("Give one constraint: response_format, regex or grammar.")
        return self._compile(asked[0])

    def _compile(self, grammar: Grammar, param: str | None = None) -> CompiledGrammar:
        """``grammar`` compiled against this bundle's tokenizer (the compiler built at the first one); an error
        names the request field ``param`` where given (a tool's schema: :class:`~.tools.ToolError`)."""
        with self._mutex:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.bundle_dir / self.manifest.tokenizer.file,
                                                 self.manifest.model.vocab_size, self.manifest.model.eos_token_ids)
        try:
            return self._grammars.compile(grammar)
        except GrammarError as exc:
            if param is None:
                raise
            why = str(exc).split(": ", 1)[-1]
            raise ToolError(f"A tool's parameters schema cannot be used: {why}", param=param) from None

    def _run(self, ids: list[int], config: GenerationConfig, stops: tuple[str, ...],
             stream: TextStream, cache_namespace: str = "", tools: ToolCallParser | None = None) -> Iterator[str]:
        tokens = self._submit(ids, config, stream.stats, stream.cancel_flag, cache_namespace)
        if tokens is None:  # cancelled while queued, or the engine closed first
            stream.cancel_unstarted()
            self._record(stream.stats, ran=False)
            return
        try:
            yield from text_deltas(tokens, self.codec.stream(), stops, stream, tools)
        finally:
            self._record(stream.stats, ran=True)

    def _submit(self, ids: list[int], config: GenerationConfig, stats: DecodeStats,
                cancelled: Callable[[], bool] | None = None, namespace: str = "") -> Iterator[int] | None:
        """The scheduler's token iterator for this generation; None if it was cancelled or the engine closed
        before it started."""
        return None if self._closed else self.scheduler.submit(ids, config, stats, cancelled, namespace)

    def generate(self, prompt: str | None = None, messages: Sequence[dict] | None = None, **kwargs) -> Completion:
        """Generate to completion; returns text, token ids, finish reason and stats."""
        stream = self.stream(prompt, messages, **kwargs)
        try:
            for _ in stream:
                pass
        finally:
            stream.close()  # a no-op once exhausted; frees the slot if a KeyboardInterrupt landed mid-way
        assert stream.completion is not None
        return stream.completion

    def generate_ids(self, ids: list[int], config: GenerationConfig, stats: DecodeStats | None = None) -> list[int]:
        """Token-level generation (no text handling), used by the bench."""
        stats = stats if stats is not None else DecodeStats()
        tokens = self._submit(ids, config, stats)
        if tokens is None:
            raise SpecDeployError("This engine is closed.")
        try:
            return list(tokens)
        finally:
            tokens.close()
            self._record(stats, ran=True)

    # --- bookkeeping --------------------------------------------------------------------------
    def _record(self, stats: DecodeStats, ran: bool) -> None:
        with self._mutex:
            t = self._totals
            t["generations"] += int(ran)
            t["cancelled"] += int(stats.finish_reason == "cancelled")
            if ran:
                t["prompt_tokens"] += stats.prompt_tokens
            t["new_tokens"] += stats.new_tokens
            t["steps"] += stats.steps
            t["step_tokens"] += sum(stats.accepted)
            if stats.new_tokens:
                self._last = (stats.tokens_per_s, stats.mean_accepted)

    def stats(self) -> EngineStats:
        """A consistent snapshot of the totals and the queue."""
        with self._mutex:
            sched = self.scheduler
            return EngineStats(**self._totals, busy_s=sched.busy_s, queue_depth=sched.waiting, running=sched.active,
                               last_tokens_per_s=self._last[0], last_tau=self._last[1])

    # --- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel queued and running streams, wait for the running step to end, then release the backend.

        A ``generate_ids`` call already running is not interrupted; close() waits for it.
        """
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            streams = list(self._streams)
        for stream in streams:
            stream.close()
        self.scheduler.close()
        self.backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(bundle: str | Path, backend: str = "ort-cpu", draft: str | None = AUTO, threads: int | None = None,
         tree: str | None = None, max_tree: int | None = None, allow_inexact: bool = False,
         progress: Callable[[str], None] | None = None, max_batch: int = 1,
         suffix_cache_tokens: int | None = None, step_plan: str | None = None) -> Engine:
    """Open a bundle for decoding. ``draft``: "auto" (the default), None or "none" (plain), "prompt-lookup",
    "ngram", "suffix", a draft kind stored in the bundle, or "hybrid[:KIND]".

    ``auto`` picks per step whichever source is worth most per unit of measured cost: prompt lookup or the
    bundle's n-gram table, the suffix cache, the bundle's trained draft, or a plain step. Where this machine
    has no exact step plan it decodes plainly, quietly (``engine.plan.reason`` says why). ``draft`` means the
    same with ``max_batch`` > 1: every batched sequence drafts with its own drafter of that source.

    Greedy speculative output is identical to plain output: at load a probe measures, bit for bit on this
    machine, which step plan keeps it so (``engine.plan``, cached; see ``runtime/plan.py``). Where none
    does, the engine decodes plainly and warns (:class:`ExactnessWarning`); ``allow_inexact`` speculates
    anyway, and every generation's ``stats.lossy`` says so. ``progress`` receives a line while probing.

    ``max_batch`` > 1 runs up to that many concurrent generations as rows of every step (the decode loop's
    own step; ``ort-cpu`` and a bundle whose exact-tree graph takes rows of several sequences). A batched
    greedy answer equals the same request's ``generate`` answer, bit for bit, where the step plan's probe found
    a sequence's rows unchanged among others' (``plan.rows``); else batching is off, with a warning, and
    ``allow_inexact`` batches anyway, labelled lossy.

    ``draft="suffix"`` drafts from the prompt and from earlier generations' outputs, kept in a cache that
    every generation of this engine shares: ``suffix_cache_tokens`` bounds it (default 16,384; 0 turns it
    off), and ``stream(..., cache_namespace=...)`` keeps groups of requests apart.

    ``step_plan`` takes a named step plan instead of the probe's choice (e.g. "gathered", whose trees are
    exact by construction, where the probe would keep a faster chains-only plan); it is probed all the same
    and refused (:class:`StepPlanError`) where it is not exact, unless ``allow_inexact``.
    """
    return Engine(bundle, backend=backend, draft=draft, threads=threads, tree=tree, max_tree=max_tree,
                  allow_inexact=allow_inexact, progress=progress, max_batch=max_batch,
                  suffix_cache_tokens=suffix_cache_tokens, step_plan=step_plan)
