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
leaving at step boundaries, and a greedy request's output is the one it gets alone on that engine
(probed bit for bit at load, :mod:`.batch_probe`). Prompt encoding and validation happen before
queueing, in the caller's thread.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from .backends import make_backend
from .batch import BatchScheduler, batch_backend, batch_draft, batch_drafter, batch_refusal
from .batch_probe import probe_batch
from .bundle import BundleManifest, read_manifest
from .decode import Decoder, DecodeStats, GenerationConfig, SamplingParams, measure_cost_curve
from .drafters import make_drafter
from .drafters.kinds import AUTO
from .errors import ExactnessWarning, PromptError, SpecDeployError
from .plan import StepPlan
from .probe import resolve_plan
from .text import TextCodec

_POLL_S = 0.05  # how often a queued caller looks at its cancel flag


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS or stop string), "length", or "cancelled" (closed before the end)
    stats: DecodeStats


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


class _Ticket:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.granted = False


class _Slot:
    """The single decode slot: held by one caller at a time and handed over in arrival order.

    A plain ``threading.Lock`` is not FIFO, so under load a caller could wait indefinitely; here a
    release hands the slot straight to the oldest waiter.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._idle = threading.Condition(self._mutex)
        self._waiters: deque[_Ticket] = deque()
        self._busy = False
        self._closed = False

    @property
    def depth(self) -> int:
        return len(self._waiters)

    @property
    def busy(self) -> bool:
        return self._busy

    def acquire(self, cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait for the slot; False if ``cancelled()`` turns true or the slot closes first."""
        with self._mutex:
            if self._closed:
                return False
            if not self._busy and not self._waiters:
                self._busy = True
                return True
            ticket = _Ticket()
            self._waiters.append(ticket)
        while True:
            ticket.event.wait(_POLL_S if cancelled is not None else None)
            with self._mutex:
                if ticket.granted:
                    if cancelled is not None and cancelled():
                        self._release_locked()
                        return False
                    return True
                if ticket.event.is_set():  # woken by close()
                    return False
                if cancelled is not None and cancelled():
                    self._waiters.remove(ticket)
                    return False

    def release(self) -> None:
        with self._mutex:
            self._release_locked()

    def _release_locked(self) -> None:
        if self._waiters:
            ticket = self._waiters.popleft()
            ticket.granted = True
            ticket.event.set()
        else:
            self._busy = False
            self._idle.notify_all()

    def close(self) -> None:
        """Turn away every waiter and new caller, then wait until the current holder releases."""
        with self._mutex:
            self._closed = True
            for ticket in self._waiters:
                ticket.event.set()
            self._waiters.clear()
            while self._busy:
                self._idle.wait()


class TextStream:
    """Iterator of text deltas; ``completion`` is set once it ends (exhausted, stopped or closed).

    ``close()`` may be called from any thread: a queued stream leaves the queue, and a running one
    stops after its current decode step and hands the engine to the next caller.
    """

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.stats = DecodeStats()  # filled in live while the generation runs
        self.completion: Completion | None = None
        self._cancel = threading.Event()
        self._deltas: Iterator[str] = iter(())

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except ValueError as exc:
            # close() from another thread raced this next(): the generator is being closed there.
            if self._cancel.is_set() and "already executing" in str(exc):
                raise StopIteration from None
            raise

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def close(self) -> None:
        """Stop generating (e.g. the client went away); releases the engine for the next caller."""
        self._cancel.set()
        close = getattr(self._deltas, "close", None)
        try:
            if close is not None:
                close()
        except ValueError:  # running in another thread, which sees the flag after this step
            return
        if self.completion is None:  # closed before it ever started
            self.stats.finish_reason = "cancelled"
            self.completion = Completion("", (), "cancelled", self.stats)


class Engine:
    def __init__(self, bundle: str | Path, backend: str = "ort-cpu", draft: str | None = AUTO,
                 threads: int | None = None, tree: str | None = None, max_tree: int | None = None,
                 allow_inexact: bool = False, progress: Callable[[str], None] | None = None, max_batch: int = 1,
                 suffix_cache_tokens: int | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise SpecDeployError(f"max_batch must be a whole number of at least 1; got {max_batch!r}.")
        self.bundle_dir = Path(bundle)
        self.manifest: BundleManifest = read_manifest(self.bundle_dir)
        self.codec = TextCodec.for_bundle(self.bundle_dir, self.manifest)
        if max_batch > 1:
            draft = batch_draft(draft, self.manifest)
            refusal = batch_refusal(self.manifest, backend, draft)
            if refusal is not None:
                raise refusal
            self.backend = batch_backend(self.bundle_dir, self.manifest, threads)
        else:
            self.backend = make_backend(backend, self.bundle_dir, self.manifest, threads=threads)
        # The step plan, measured on this machine (cached per CPU, ONNX Runtime version and bundle): plain
        # and speculative decoding both follow it, whether or not this engine drafts.
        self.plan: StepPlan = resolve_plan(self.backend, self.manifest, allow_inexact=allow_inexact,
                                           progress=progress)
        self.draft_name = draft or "none"
        if self.draft_name == AUTO and not self.plan.speculate:
            self.draft_name = "none"  # the default declines quietly: engine.plan says why
        elif self.draft_name != "none" and not self.plan.speculate:
            warnings.warn(f"The '{self.draft_name}' draft is not used: {self.plan.reason}", ExactnessWarning,
                          stacklevel=3)
            self.draft_name = "none"
        self._batch: BatchScheduler | None = None
        self.batch_reason = "one generation at a time (max_batch 1)."
        if max_batch > 1:
            self._batch = self._batching(max_batch, allow_inexact, progress)
        self.max_batch = self._batch.max_batch if self._batch else 1  # 1 where the batch probe turned it off
        drafter = None if self._batch else make_drafter(self.draft_name, self.bundle_dir, self.manifest, tree=tree,
                                                        threads=threads, chains=not self.plan.trees,
                                                        backend=self.backend, suffix_cache_tokens=suffix_cache_tokens)
        self.decoder = self._batch.decoder if self._batch else Decoder(self.backend, self.manifest, drafter,
                                                                        max_tree=max_tree, plan=self.plan)
        self.backend.release_unused()
        self.cost_curve: dict[int, float] | None = None  # measured when the drafter trades length for cost
        if drafter is not None and drafter.needs_cost_curve:
            # The drafter sizes its drafts by step cost: measure this backend's (~1 s).
            self.cost_curve = measure_cost_curve(self.decoder)
            self.decoder.track_costs(self.cost_curve)  # then re-estimated from the decode loop's steps
        self._slot = _Slot()
        self._mutex = threading.Lock()  # guards the totals below and the set of open streams
        self._streams: weakref.WeakSet[TextStream] = weakref.WeakSet()
        self._totals = {"generations": 0, "cancelled": 0, "prompt_tokens": 0, "new_tokens": 0, "steps": 0,
                        "step_tokens": 0}
        self._busy_s = 0.0
        self._last = (0.0, 1.0)  # tokens/s and tau of the last generation
        self._closed = False

    def _batching(self, max_batch: int, allow_inexact: bool, progress: Callable[[str], None] | None
                  ) -> BatchScheduler:
        """The continuous-batching scheduler, with the layout the batch probe measured on this machine."""
        if progress is not None:
            progress("probing whether batched rows equal lone rows on this machine ...")
        verdict = probe_batch(self.backend, self.manifest)
        self.batch_reason = verdict.reason
        if not verdict.exact:
            if not allow_inexact:
                warnings.warn(f"Batching is off: {verdict.reason}; pass allow_inexact to batch anyway, labelled "
                              "lossy.", ExactnessWarning, stacklevel=4)
                self.batch_reason = f"batching off: {verdict.reason}."
                max_batch = 1
            else:
                self.batch_reason = f"LOSSY batching (allow_inexact): {verdict.reason}."
        return BatchScheduler(self.backend, self.manifest, self.plan, max_batch, verdict.period or 1,
                              drafter=batch_drafter(self.draft_name, self.bundle_dir, self.manifest),
                              lossy=not verdict.exact and max_batch > 1)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_context(self) -> int:
        return self.manifest.limits.max_context

    # --- prompts ----------------------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
               chat: bool = False) -> list[int]:
        if (prompt is None) == (messages is None):
            raise PromptError("Give either a prompt or a messages list, not both.")
        if messages is not None:
            return self.codec.encode_chat(messages)
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError("The prompt is empty.")
        if chat:
            return self.codec.encode_chat([{"role": "user", "content": prompt}])
        return self.codec.encode(prompt)

    # --- generation -------------------------------------------------------------------------
    def stream(self, prompt: str | None = None, messages: Sequence[dict] | None = None, *,
               max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               stop: Sequence[str] = (), seed: int | None = None, chat: bool = False,
               typical: bool = False, cache_namespace: str = "") -> TextStream:
        """Stream text deltas. Validation happens here; the stream queues for the engine at its first ``next()``.
        ``cache_namespace``: the part of a cross-request draft cache (the suffix draft's) this generation reads
        and adds to; "" shares it with every generation that passes "" (the default)."""
        if self._closed:
            raise SpecDeployError("This engine is closed.")
        if isinstance(stop, str):
            stop = (stop,)
        ids = self.encode(prompt, messages, chat)
        config = GenerationConfig(max_new_tokens, SamplingParams(temperature, top_p, top_k, seed, typical))
        self.decoder.check_prompt(ids, config)
        stops = tuple(s for s in stop if s)
        stream = TextStream(len(ids))
        stream._deltas = self._run(ids, config, stops, stream, cache_namespace)
        with self._mutex:
            self._streams.add(stream)
        return stream

    def _run(self, ids: list[int], config: GenerationConfig, stops: tuple[str, ...],
             stream: TextStream, cache_namespace: str = "") -> Iterator[str]:
        stats = stream.stats
        gen: Iterator[int] | None = None
        release: Callable[[], None] = _no_op
        if self._batch is not None:
            try:
                gen = self._batch.submit(ids, config, stats, stream._cancel.is_set)
            except SpecDeployError:
                if not self._closed:
                    raise  # closed before it queued: cancelled, like a closed slot below
        elif self._slot.acquire(stream._cancel.is_set):
            release = self._slot.release
            if hasattr(self.decoder.drafter, "namespace"):  # set while this stream holds the slot
                self.decoder.drafter.namespace = cache_namespace
            gen = self.decoder.generate(ids, config, stats)
        if gen is None:
            stats.finish_reason = "cancelled"
            stream.completion = Completion("", (), "cancelled", stats)
            self._record(stats, 0.0, ran=False)
            return
        t0 = time.perf_counter()
        detok = self.codec.stream()
        hold = max((len(s) for s in stops), default=1) - 1  # chars that might start a stop string
        emitted_len, tokens, reason = 0, [], ""
        try:
            for tok in gen:
                if stream._cancel.is_set():
                    reason = "cancelled"
                    break
                tokens.append(tok)
                detok.push([tok])
                text = detok.text
                hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if hit >= 0:
                    if hit > emitted_len:
                        yield text[emitted_len:hit]
                    emitted_len, reason = hit, "stop"
                    break
                safe = len(text) - hold if stops else len(text)
                if safe > emitted_len:
                    yield text[emitted_len:safe]
                    emitted_len = safe
            else:
                reason = stats.finish_reason
                if len(detok.text) > emitted_len:
                    yield detok.text[emitted_len:]
                    emitted_len = len(detok.text)
        finally:
            # Also runs when the stream is closed at a yield (GeneratorExit): the slot is always freed.
            gen.close()
            release()
            if not reason:  # closed at a yield, or an error escaped the decoder
                reason = "cancelled" if stream._cancel.is_set() or not stats.finish_reason else stats.finish_reason
            stats.finish_reason = reason
            stream.completion = Completion(detok.text[:emitted_len], tuple(tokens), stats.finish_reason, stats)
            self._record(stats, time.perf_counter() - t0, ran=True)

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
        if self._batch is not None:
            if self._closed:
                raise SpecDeployError("This engine is closed.")
            t0 = time.perf_counter()
            try:
                return list(self._batch.submit(ids, config, stats))
            finally:
                self._record(stats, time.perf_counter() - t0, ran=True)
        if not self._slot.acquire():
            raise SpecDeployError("This engine is closed.")
        t0 = time.perf_counter()
        try:
            return list(self.decoder.generate(ids, config, stats))
        finally:
            self._slot.release()
            self._record(stats, time.perf_counter() - t0, ran=True)

    # --- bookkeeping --------------------------------------------------------------------------
    def _record(self, stats: DecodeStats, busy_s: float, ran: bool) -> None:
        with self._mutex:
            t = self._totals
            t["generations"] += int(ran)
            t["cancelled"] += int(stats.finish_reason == "cancelled")
            if ran:
                t["prompt_tokens"] += stats.prompt_tokens
            t["new_tokens"] += stats.new_tokens
            t["steps"] += stats.steps
            t["step_tokens"] += sum(stats.accepted)
            self._busy_s += busy_s
            if stats.new_tokens:
                self._last = (stats.tokens_per_s, stats.mean_accepted)

    def stats(self) -> EngineStats:
        """A consistent snapshot of the totals and the queue."""
        with self._mutex:
            if self._batch is not None:  # requests overlap: the scheduler's own busy time counts
                return EngineStats(**self._totals, busy_s=self._batch.busy_s, queue_depth=self._batch.waiting,
                                   running=self._batch.active, last_tokens_per_s=self._last[0],
                                   last_tau=self._last[1])
            return EngineStats(**self._totals, busy_s=self._busy_s, queue_depth=self._slot.depth,
                               running=int(self._slot.busy), last_tokens_per_s=self._last[0],
                               last_tau=self._last[1])

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
        if self._batch is not None:
            self._batch.close()
        self._slot.close()
        self.backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_op() -> None:
    pass


def load(bundle: str | Path, backend: str = "ort-cpu", draft: str | None = AUTO, threads: int | None = None,
         tree: str | None = None, max_tree: int | None = None, allow_inexact: bool = False,
         progress: Callable[[str], None] | None = None, max_batch: int = 1,
         suffix_cache_tokens: int | None = None) -> Engine:
    """Open a bundle for decoding. ``draft``: "auto" (the default), None or "none" (plain), "prompt-lookup",
    "ngram", "suffix", a draft kind stored in the bundle, or "hybrid[:KIND]".

    ``auto`` picks per step whichever source is worth most per unit of measured cost: prompt lookup or the
    bundle's n-gram table, the suffix cache, the bundle's trained draft, or a plain step. Where this machine
    has no exact step plan it decodes plainly, quietly (``engine.plan.reason`` says why); batched
    (``max_batch`` > 1) it drafts with the free source batching has (the n-gram table, else prompt lookup).

    Greedy speculative output is identical to plain output: at load a probe measures, bit for bit on this
    machine, which step plan keeps it so (``engine.plan``, cached; see ``runtime/plan.py``). Where none
    does, the engine decodes plainly and warns (:class:`ExactnessWarning`); ``allow_inexact`` speculates
    anyway, and every generation's ``stats.lossy`` says so. ``progress`` receives a line while probing.

    ``max_batch`` > 1 batches up to that many concurrent generations in every step (``ort-cpu`` and a
    bundle with a standard-op graph; drafts: prompt lookup, ngram or none). It runs that graph for every
    step, so its outputs are that graph's; a batched greedy request equals the same request alone on
    the engine, bit for bit, where the batch probe says so (else batching is off, with a warning).

    ``draft="suffix"`` drafts from the prompt and from earlier generations' outputs, kept in a cache that
    every generation of this engine shares: ``suffix_cache_tokens`` bounds it (default 16,384; 0 turns it
    off), and ``stream(..., cache_namespace=...)`` keeps groups of requests apart.
    """
    return Engine(bundle, backend=backend, draft=draft, threads=threads, tree=tree, max_tree=max_tree,
                  allow_inexact=allow_inexact, progress=progress, max_batch=max_batch,
                  suffix_cache_tokens=suffix_cache_tokens)
