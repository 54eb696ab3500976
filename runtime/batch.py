"""Continuous batching: every active sequence brings its rows to one decode step (``load(..., max_batch=N)``).

A scheduler thread owns the backend. Requests wait in arrival order and join at step boundaries: a
joining prompt is prefilled alone (batch 1, as it would be with no one else), its K/V copied into a
free row of the shared cache, and from then on each step is the decode loop's own :meth:`~.decode.Decoder.step` over
every active sequence, one batch row each (:mod:`.rows`): its root and the draft rows its drafter earned,
padded to the step's rows. This module keeps only admission, eviction and cancellation. A sequence that ends (EOS, its token budget, the context, or its caller went away) leaves after that step
and its row goes to the next request.

**The same answer at any load.** The step plan (:mod:`.plan`) batches only where its probe found a
sequence's rows computed bit for bit as alone whatever else the step holds (``StepPlan.rows``: the gathered
layout, each row's keys in plain-step order). A request's greedy answer is then the one ``generate`` gives
on the same bundle, and speculation stays exact in a batch. Where no plan is so, the engine serves one
request at a time (:class:`~.scheduler.SerialScheduler`) unless ``allow_inexact`` asks for lossy batching.

**Speculation fades with load.** Each sequence keeps its own drafter (prompt lookup, the bundle's n-gram
table, the suffix cache shared across requests, or ``auto``'s choice between them) and its own earned
acceptance. Every step the rows per sequence ``T`` are chosen to maximise the batch's expected tokens
per unit of the measured cost of a step of ``B x T`` rows (:func:`~.rows.rows_per_sequence`, on the
curve a :class:`~.cost_meter.StepCostMeter` keeps from the loop's own steps), so a draft row is spent only
where it returns more than it costs the batch. A sequence alone in the batch drafts as ``generate`` does.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .cost_curve import measure_cost_curve
from .decode import Decoder, DecodeStats, Generation, GenerationConfig
from .drafters.base import Drafter
from .drafters.kinds import AUTO, NGRAM, NONE, PROMPT_LOOKUP, SUFFIX
from .kvcache import KVCache, bucket_for

if TYPE_CHECKING:
    from pathlib import Path

    from .backends.base import Backend
    from .bundle import BundleManifest
    from .plan import StepPlan

_END = object()
_IDLE_POLL_S = 0.05  # how often an idle scheduler looks at waiting callers' cancel flags
MAX_DRAFT = 10  # longest chain per sequence
# A growing cache gets 1/_SPARE_PART of its need spare. Each step reads every column of the keys, and a growth copies
# every row's columns, so the spare that balances the two rises with the context (about as its square root): next to
# none at a few hundred tokens, where 128 spare columns cost a step of 16-32 sequences 5-9% on the Xeon family 6
# model 167, and a few hundred columns at several thousand, where each growth copies gigabytes.
_SPARE_PART = 16


def drafter_factory(draft: str | None, bundle_dir: Path, manifest: BundleManifest, suffix_cache_tokens: int | None = None,
                    threads: int | None = None, backend: Backend | None = None, chains: bool = True
                    ) -> Callable[[], Drafter] | None:
    """What makes each batched sequence's own drafter for ``draft``, or None for plain decoding: the same sources
    ``generate`` uses, with the n-gram table, the suffix cache and what the suffix drafts earned shared by every
    sequence (a trained draft: its loaded graph and what it has earned shared, a draft cache per sequence).
    ``chains`` False (a plan that verifies trees): trees as ``generate`` drafts them, for a sequence alone in a
    step; beside others a step takes each tree's main path. A draft the bundle lacks or does not know fails here,
    in one sentence, before anything is served."""
    from .drafters import make_drafter
    from .drafters.hybrid import HybridDrafter
    from .drafters.kinds import AUTO_MODELS
    from .drafters.make import DraftRequest, bundle_lookup, suffix_cache, trained
    from .drafters.prompt_lookup import PromptLookupDrafter
    from .drafters.suffix import SuffixDrafter

    if draft in (None, "", NONE):
        return None
    req = DraftRequest(draft, bundle_dir, manifest, threads=threads, chains=chains, backend=backend,
                       suffix_cache_tokens=suffix_cache_tokens)
    first: list[Drafter] = []  # the first sequence's drafter with a trained draft: later ones share with it

    def sharing(drafter: Drafter) -> Drafter:
        """As generate's keeps them across requests, a batch's sequences share what their trained draft earned
        and what its calls cost: a new one does not try a draft that has stopped paying, nor price a call unseen."""
        if not isinstance(drafter, HybridDrafter):
            return drafter
        if first:
            drafter.share_estimates(first[0])
        else:
            first.append(drafter)
        return drafter

    if draft not in (PROMPT_LOOKUP, NGRAM, SUFFIX, AUTO):  # a trained draft, or a hybrid with one
        return lambda: sharing(make_drafter(draft, bundle_dir, manifest, threads=threads, chains=chains,
                                            backend=backend))
    table = getattr(bundle_lookup(req), "table", None) if draft in (NGRAM, AUTO) else None
    if draft == NGRAM and table is None:
        from .drafters.ngram import load_ngram_drafter

        load_ngram_drafter(bundle_dir, manifest)  # the bundle has no table: its one sentence
    cache = suffix_cache(req) if draft in (SUFFIX, AUTO) else None
    calibration = SuffixDrafter.calibration()  # the suffix drafters' record, shared as their cache is
    has = {d.kind for d in manifest.drafts}
    model = next((k for k in AUTO_MODELS if k in has), None) if draft == AUTO else None
    shape = {"branches": 1, "num_tokens": MAX_DRAFT} if chains else {}  # trees: lookup's own default shape

    def lookup() -> PromptLookupDrafter:
        if table is None:
            return PromptLookupDrafter(**shape)
        from .drafters.ngram import NgramDrafter

        return NgramDrafter(table, **shape)

    def with_model(free) -> Drafter:
        from .drafters.auto import AutoDrafter

        return sharing(AutoDrafter((first[0].model.spawn() if first else None) or trained(model, req), free,
                                   chains=chains))

    def make() -> Drafter:
        from .drafters.auto import FreeSources

        if draft in (PROMPT_LOOKUP, NGRAM):
            return lookup()
        if draft == SUFFIX:
            return SuffixDrafter(cache, chains=chains, calibration=calibration)
        free = FreeSources(lookup(), SuffixDrafter(cache, chains=chains, calibration=calibration))
        return free if model is None else with_model(free)

    return make


class _Seq(Generation):
    """One request: a generation of the decode loop, and where its tokens go."""

    def __init__(self, ids: list[int], config: GenerationConfig, stats: DecodeStats,
                 cancelled: Callable[[], bool], drafter: Drafter | None):
        super().__init__(ids, config, stats, drafter)
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = cancelled
        self.left = threading.Event()  # set when the caller stopped reading

    def cancelled(self) -> bool:
        return self.left.is_set() or self._cancelled()

    def hand_over(self) -> None:
        """The tokens its last step emitted, to its caller."""
        for t in self.emitted:
            self.out.put(t)


class BatchScheduler:
    """N decode slots over one backend; ``submit`` returns a token iterator, like ``Decoder.generate``."""

    def __init__(self, backend: Backend, manifest: BundleManifest, plan: StepPlan, max_batch: int,
                 new_drafter: Callable[[], Drafter] | None = None, lossy: bool = False):
        self.backend, self.manifest, self.plan = backend, manifest, plan
        backend.forget_buffers()  # the probes' scratch caches are freed: nothing may alias new buffers
        self.max_batch = max_batch
        self.lossy = lossy  # rows of several sequences are not bitwise as alone here (allow_inexact)
        # a sequence's rows: a tree as generate's where the plan verifies trees (alone in a step), else a chain
        rows = plan.max_rows if plan.trees else min(plan.max_rows, MAX_DRAFT + 1)
        self.max_rows = rows if new_drafter is not None and plan.speculate else 1
        self.decoder = Decoder(backend, manifest, None, max_tree=self.max_rows, plan=plan)  # the decode loop
        self.limit = manifest.limits.max_context
        self.min_rows = plan.min_rows
        self.draft = self.max_rows > 1
        self._new_drafter = new_drafter  # a drafter per sequence (its state is the sequence's)
        self._spare: list[Drafter] = []  # drafters of requests that ended, for the next ones (a model is kept)
        if new_drafter is not None:  # the first made now: a draft the base's graph cannot feed fails at load
            first = new_drafter()
            self.decoder.check_drafter(first)
            self._spare.append(first)
        # Capacities in steps of 64 columns, not doublings: the cache holds up to max_batch rows of fp32 K/V.
        top = self.limit + max(self.max_rows, self.min_rows)
        self.buckets = (*range(64, top, 64), top)
        self._full = backend.new_cache(1, self.buckets[0])  # rows grow by doublings as sequences join
        self._view: KVCache | None = None  # the rows of the cache that the next step runs
        self._view_rows = (0, 0)  # which: [first, last + 1)
        self.rows: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()
        self._joining: list[_Seq] = []  # taken from the queue, not yet rows
        self._cv = threading.Condition()
        self._closed = False
        self.busy_s = 0.0
        self.steps = 0
        # The cost of a step by its rows, measured at load (~1 s) and then from the loop's steps.
        if self.draft:
            # up to the rows a step of several sequences may run alone, not only one sequence's
            self.decoder.track_costs(measure_cost_curve(self.decoder, largest=plan.max_rows))
            backend.forget_buffers()  # the measurement's scratch cache is freed
        self._thread = threading.Thread(target=self._loop, name="specdeploy-batch", daemon=True)
        self._thread.start()

    # --- the caller's side ----------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def cache_rows(self) -> int:
        """Rows the shared cache holds now: doublings up to ``max_batch``, as many as the sequences need."""
        return self._full.batch

    @property
    def active(self) -> int:
        """Generations out of the queue: decoding, or being prefilled to join."""
        return len(self.rows) + len(self._joining)

    def submit(self, ids: list[int], config: GenerationConfig, stats: DecodeStats,
               cancelled: Callable[[], bool] | None = None, namespace: str = "") -> Iterator[int] | None:
        """Queue a generation; the iterator yields its tokens as the batch makes them, None once the scheduler
        closed. ``namespace``: the part of the shared suffix cache its drafter reads and adds to."""
        cancelled = cancelled or (lambda: False)
        self.decoder.check_prompt(ids, config)
        stats.prompt_tokens = len(ids)
        stats.lossy = self.lossy or (self.draft and self.plan.lossy) or (
            config.sampling.typical and not config.sampling.greedy)
        drafter = None
        if self.draft:
            with self._cv:
                drafter = self._spare.pop() if self._spare else None
            drafter = drafter or self._new_drafter()
            drafter.use_cost_curve(self.decoder.cost_curve)  # sized as alone; the batch rule trims it to what pays
            if hasattr(drafter, "namespace"):
                drafter.namespace = namespace
        seq = _Seq(ids, config, stats, cancelled, drafter)
        with self._cv:
            if self._closed:
                return None
            self._waiting.append(seq)
            self._cv.notify()
        return self._tokens(seq)

    @staticmethod
    def _tokens(seq: _Seq) -> Iterator[int]:
        try:
            while True:
                item = seq.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            seq.left.set()  # closed early: the scheduler drops the row after its current step

    def close(self) -> None:
        """Finish every queued and running request as cancelled, after the step in progress."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    # --- the scheduler thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    break
                if not self.rows and not self._waiting:
                    self._cv.wait(_IDLE_POLL_S)
                    continue
            try:
                t0 = time.perf_counter()
                self._admit()
                if self.rows:
                    self._step()
                self.busy_s += time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - handed to every caller in flight
                for seq in self._take_all():
                    seq.stats.finish_reason = "error"
                    seq.out.put(exc)
                self.backend.forget_buffers()
        for seq in self._take_all():
            self._finish(seq, "cancelled")

    def _take_all(self) -> list[_Seq]:
        """Empty the rows and the queue, and return who was in them: they are free before a caller hears."""
        left = self.rows + self._joining + list(self._waiting)
        self.rows.clear()
        self._joining.clear()
        self._waiting.clear()
        self._view = None
        return left

    def _finish(self, seq: _Seq, reason: str) -> None:
        seq.stats.finish_reason = reason
        if seq.t_decode:
            seq.stats.decode_s = time.perf_counter() - seq.t_decode
        if seq.drafter is not None:  # e.g. the suffix cache learns the output; the drafter serves the next request
            seq.drafter.finished(seq.tokens, seq.prompt_len)
            with self._cv:
                self._spare.append(seq.drafter)
            seq.drafter = None
        seq.out.put(_END)

    def _admit(self) -> None:
        """Cancelled waiters leave; waiting ones join, oldest first, while a row is free."""
        with self._cv:
            for seq in [s for s in self._waiting if s.cancelled()]:
                self._waiting.remove(seq)
                self._finish(seq, "cancelled")
            while self._waiting and len(self.rows) + len(self._joining) < self.max_batch:
                self._joining.append(self._waiting.popleft())
        joining = self._joining
        if joining:  # room for the longest prompt's plain step: at most one resize for all of them
            self._fit(max(len(s.tokens) for s in joining) + self.min_rows, len(self.rows) + len(joining))
        while joining:
            self._join(joining[0])
            joining.pop(0)

    def _join(self, seq: _Seq) -> None:
        t0 = time.perf_counter()
        n = len(seq.tokens)
        self.backend.forget_buffers()  # nothing stale may alias the prefill's new cache
        state, out = self.decoder.prefill(seq.tokens)  # batch 1, as alone
        seq.stats.prefill_s = time.perf_counter() - t0
        seq.t_decode = time.perf_counter()
        reason = self.decoder.start(seq, state, out)
        seq.hand_over()
        if reason is not None:
            self.backend.forget_buffers()  # the prefill's cache is freed now
            self._finish(seq, reason)
            return
        r = len(self.rows)
        for dst, src in zip(self._full.buffers(), state.cache.buffers()):
            dst[r, :, :n] = src[0, :, :n]  # its token i at column i, as alone
        self.rows.append(seq)
        self._view = None
        self.backend.forget_buffers()

    # --- one step over the batch: the decode loop's own -------------------------------------------
    def _step(self) -> None:
        for seq in [s for s in self.rows if s.cancelled()]:
            self._leave(seq, "cancelled")
        if not self.rows:
            return
        reasons = self.decoder.step(self.rows, self._cache_for)
        self.steps += 1
        done = []
        for seq, reason in zip(self.rows, reasons):
            seq.hand_over()
            if reason is not None:
                done.append((seq, reason))
        for seq, reason in done:
            self._leave(seq, reason)

    def _cache_for(self, columns: int, row: int | None = None) -> KVCache:
        """The first rows of the shared cache, one per active sequence (or ``row`` alone), with at least ``columns``
        columns."""
        self._fit(columns)
        rows = (0, len(self.rows)) if row is None else (row, row + 1)
        if self._view is None or self._view_rows != rows:
            part = slice(*rows)
            self._view = KVCache([k[part] for k in self._full.keys], [v[part] for v in self._full.values], 0,
                                 self._full.allocate)
            self._view_rows = rows
            self.backend.forget_buffers()  # a view of other rows: nothing may alias the last one
        return self._view

    def _leave(self, seq: _Seq, reason: str) -> None:
        """Drop a row (the last row moves into its place, one row's copy), then finish its request."""
        r, last = self.rows.index(seq), len(self.rows) - 1
        if r != last:
            n = self.rows[last].committed
            for buf in self._full.buffers():
                buf[r, :, :n] = buf[last, :, :n]
            self.rows[r] = self.rows[last]
        self.rows.pop()
        self._view = None
        self.backend.forget_buffers()
        self._finish(seq, reason)

    def _fit(self, need: int, sequences: int = 0) -> None:
        """A cache of at least ``need`` columns and ``sequences`` rows: grown (rows copied) when it has fewer, to the
        smallest bucket that holds ``need`` and a sixteenth spare (``_SPARE_PART``), and
        re-sized to fit the coming prompts when the batch is empty (a capacity that earlier requests needed would
        hold memory and widen every step's mask). Rows come in doublings up to ``max_batch``, as sequences need
        them: each resize allocates every row zeroed (about 45 ms for 32 rows of 256 columns of this model), a few
        times a request."""
        wanted = min(self.max_batch, 1 << (max(sequences, 1) - 1).bit_length())
        if self.rows:  # never fewer rows or columns while sequences are in it
            rows, cap = max(self._full.batch, wanted), self._full.capacity
            if need > cap:
                cap = bucket_for(min(need + need // _SPARE_PART, self.buckets[-1]), self.buckets)
        else:
            rows = wanted if sequences else self._full.batch
            cap = bucket_for(min(need, self.buckets[-1]), self.buckets)
        if cap == self._full.capacity and rows == self._full.batch:
            return
        new = self.backend.new_cache(rows, cap)
        for r, seq in enumerate(self.rows):
            for dst, src in zip(new.buffers(), self._full.buffers()):
                dst[r, :, : seq.committed] = src[r, :, : seq.committed]
        self._full = new
        self._view = None
        self.backend.forget_buffers()
