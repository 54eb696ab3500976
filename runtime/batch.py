"""Continuous batching: every active sequence is one row of one decode step (``load(..., max_batch=N)``).

A scheduler thread owns the backend. Requests wait in arrival order and join at step boundaries: a
joining prompt is prefilled alone (batch 1, as it would be with no one else), its K/V copied into a
free row of the shared cache, and from then on each step runs every active sequence as one row of the
batch dimension of the bundle's standard-op graph. A sequence that ends (EOS, its token budget, the
context, or its caller went away) leaves after that step and its row goes to the next request.

**Layout.** The graph writes a step's T new rows at columns shared by the whole batch, so each
sequence keeps its tokens at the columns the shared write pointer gives it. Whether that changes a
row's arithmetic is measured at load (:mod:`.batch_probe`): on the machines measured, only the
columns' alignment modulo a small period ``p`` matters. So the scheduler keeps every sequence's token
``i`` at a column congruent to ``i`` modulo ``p``: a prompt joins only when the write pointer has its
length's residue (at most ``p - 1`` steps' wait), and a repack moves rows only in ways that keep it.
A greedy request then gives, token for token, the output it gives alone on this engine.

**Speculation that adapts to load.** With a ``prompt-lookup`` or ``ngram`` draft, a sequence that has
the batch to itself drafts a lookup (or n-gram table) chain, sized by the measured cost of T-row steps,
exactly as alone. Two or more rows decode plainly: a batch already reads the weights once for many
tokens, and rows that accept different numbers of tokens would need the shared write pointer to advance
by different amounts.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from .backends.base import StepInputs
from .decode import Decoder, DecodeStats, GenerationConfig, measure_cost_curve
from .drafters.kinds import AUTO, KINDS, NGRAM, NONE, PROMPT_LOOKUP
from .drafters.prompt_lookup import PromptLookupDrafter
from .errors import BackendUnavailableError, BundleError, DraftMismatchError, SpecDeployError
from .kvcache import KVCache, bucket_for
from .verify import position_rng, sample_from, warp_logits

if TYPE_CHECKING:
    from pathlib import Path

    from .backends.base import Backend
    from .bundle import BundleManifest
    from .plan import StepPlan

_END = object()
_IDLE_POLL_S = 0.05  # how often an idle scheduler looks at waiting callers' cancel flags
_HEADROOM = 64  # spare columns after a repack, so the shared cache is not repacked every step
MAX_DRAFT = 10  # longest lookup chain per row


BATCH_DRAFTS = (None, "", NONE, *(k.name for k in KINDS if k.batches))  # prompt-lookup, ngram


def batch_draft(draft: str | None, manifest: BundleManifest) -> str | None:
    """The draft batched rows use for ``draft``: ``auto`` (per-step sources for one sequence) becomes the free
    source batching has, the bundle's n-gram table where it has one, else prompt lookup."""
    if draft != AUTO:
        return draft
    return NGRAM if any(d.kind == NGRAM for d in manifest.drafts) else PROMPT_LOOKUP


def batch_refusal(manifest: BundleManifest, backend: str, draft: str | None) -> SpecDeployError | None:
    """The one-sentence error that batching this bundle, backend and draft meets, or None when it can batch."""
    if backend != "ort-cpu":
        return BackendUnavailableError(f"Batching (max_batch > 1) runs on the ort-cpu backend only, not '{backend}'.")
    if draft not in BATCH_DRAFTS:
        return DraftMismatchError(f"Batching (max_batch > 1) drafts with prompt lookup or ngram only; the '{draft}' "
                                  "draft needs max_batch 1.")
    if manifest.find_graph("base", "trt") is None:
        return BundleError("The bundle has no standard-op base graph, which batching needs (ONNX Runtime's fused "
                           "attention takes one sequence at a time); export it with --target all, or use max_batch 1.")
    return None


def batch_drafter(draft: str | None, bundle_dir: Path, manifest: BundleManifest) -> Callable[[], PromptLookupDrafter] | None:
    """What makes each batched sequence's drafter (one chain, at most ``MAX_DRAFT`` tokens), or None."""
    if draft == PROMPT_LOOKUP:
        return lambda: PromptLookupDrafter(branches=1, num_tokens=MAX_DRAFT)
    if draft == NGRAM:
        from .drafters.ngram import NgramDrafter, load_ngram_drafter

        table = load_ngram_drafter(bundle_dir, manifest).table  # one table, shared by every sequence
        return lambda: NgramDrafter(table, branches=1, num_tokens=MAX_DRAFT)
    return None


def batch_backend(bundle_dir: Path, manifest: BundleManifest, threads: int | None) -> Backend:
    """The backend batching runs: ONNX Runtime on the CPU with the bundle's standard-op base graph."""
    from .backends.ort import OrtBackend

    return OrtBackend(bundle_dir, manifest, provider="cpu", threads=threads, graph=manifest.graph("base", "trt"))


class _Seq:
    """One request: its tokens, what is not yet in the cache, its sampling and where its tokens go."""

    def __init__(self, ids: list[int], config: GenerationConfig, stats: DecodeStats,
                 cancelled: Callable[[], bool], drafter: PromptLookupDrafter | None):
        self.tokens = list(ids)  # prompt + emitted
        self.root = 0  # the last token, fed next (its K/V is not in the cache yet)
        self.committed = 0  # tokens whose K/V is in the cache
        self.config, self.stats, self.drafter = config, stats, drafter
        self.rng = np.random.default_rng(config.sampling.seed)
        self.remaining = config.max_new_tokens
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = cancelled
        self.left = threading.Event()  # set when the caller stopped reading
        self.t_join = 0.0

    def cancelled(self) -> bool:
        return self.left.is_set() or self._cancelled()


class BatchScheduler:
    """N decode slots over one backend; ``submit`` returns a token iterator, like ``Decoder.generate``."""

    def __init__(self, backend: Backend, manifest: BundleManifest, plan: StepPlan, max_batch: int, period: int,
                 drafter: Callable[[], PromptLookupDrafter] | None = None, lossy: bool = False):
        self.backend, self.manifest, self.plan = backend, manifest, plan
        backend.forget_buffers()  # the probes' scratch caches are freed: nothing may alias new buffers
        self.max_batch, self.period = max_batch, period
        self.lossy = lossy  # batched rows are not bitwise a lone row's here (allow_inexact)
        self.decoder = Decoder(backend, manifest, None, plan=plan)  # prefills and prompt checks
        self.limit = manifest.limits.max_context
        self.max_rows = min(plan.max_rows, MAX_DRAFT + 1) if drafter is not None and plan.speculate else 1
        self.draft = self.max_rows > 1
        self._new_drafter = drafter  # a lookup drafter per sequence (its state is the sequence's)
        # Capacities in steps of 64 columns, not doublings: every row attends over the whole capacity, and
        # at 32 rows a step over 1024 columns took 1.8x one over 320 (AMD EPYC, fp32).
        top = self.limit + self.max_rows + _HEADROOM
        self.buckets = (*range(2 * _HEADROOM, top, _HEADROOM), top)
        self.eos = frozenset(manifest.model.eos_token_ids)
        self._neg = np.finfo(backend.mask_dtype).min
        self._full = backend.new_cache(max_batch, self.buckets[0])
        self._view: KVCache | None = None
        self._seen = np.zeros((max_batch, self._full.capacity), dtype=bool)  # per row, the columns it attends
        self.col = 0  # the next write column, shared by every row
        self.rows: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()
        self._joining: list[_Seq] = []  # taken from the queue, not yet rows
        self._cv = threading.Condition()
        self._closed = False
        self.busy_s = 0.0
        self.steps = 0
        # A lone row's chain is sized by the cost of T-row steps on this backend (~1 s to measure).
        self.cost: dict[int, float] = measure_cost_curve(self.decoder) if self.draft else {1: 1.0}
        backend.forget_buffers()  # the measurement's scratch cache is freed
        self._thread = threading.Thread(target=self._loop, name="specdeploy-batch", daemon=True)
        self._thread.start()

    # --- the caller's side ----------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Generations out of the queue: decoding, or being prefilled to join."""
        return len(self.rows) + len(self._joining)

    def submit(self, ids: list[int], config: GenerationConfig, stats: DecodeStats,
               cancelled: Callable[[], bool] | None = None, namespace: str = "") -> Iterator[int] | None:
        """Queue a generation; the iterator yields its tokens as the batch makes them, None once the scheduler
        closed. (``namespace`` is the :class:`~.scheduler.Scheduler`'s: batched rows draft from their own context
        only.)"""
        cancelled = cancelled or (lambda: False)
        self.decoder.check_prompt(ids, config)
        stats.prompt_tokens = len(ids)
        stats.lossy = self.lossy or (self.draft and self.plan.lossy)
        drafter = self._new_drafter() if self.draft else None
        if drafter is not None:
            drafter.use_cost_curve(self.cost)
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
        if seq.t_join:
            seq.stats.decode_s = time.perf_counter() - seq.t_join
        seq.out.put(_END)

    def _admit(self) -> None:
        """Cancelled waiters leave; aligned ones join, oldest first, while a row is free."""
        with self._cv:
            for seq in [s for s in self._waiting if s.cancelled()]:
                self._waiting.remove(seq)
                self._finish(seq, "cancelled")
            joining = self._joining
            for seq in list(self._waiting):
                if len(self.rows) + len(joining) == self.max_batch:
                    break
                n = len(seq.tokens)
                if (self.rows or joining) and (self.col - n) % self.period:
                    continue  # not this step: its tokens would sit off the alignment
                if not self.rows and not joining:
                    self.col = n
                self._waiting.remove(seq)
                joining.append(seq)
        if joining:  # room for the longest prompt and the steps ahead: one repack for all of them
            end = max(len(s.tokens) for s in joining)  # of the write pointer's residue, like each joiner's
            if not self.rows:  # an empty batch: a cache sized for these prompts (it may have grown before)
                self.col = max(self.col, end)
            if not self.rows or end > self.col or self.col + self.max_rows + 2 > self._full.capacity:
                self._repack(min_col=end)
        while joining:
            self._join(joining[0])
            joining.pop(0)

    def _join(self, seq: _Seq) -> None:
        t0 = time.perf_counter()
        n = len(seq.tokens)
        self.backend.forget_buffers()  # nothing stale may alias the prefill's new cache
        state, out = self.decoder.prefill(seq.tokens)  # batch 1, as alone
        seq.stats.prefill_s = time.perf_counter() - t0
        seq.t_join = time.perf_counter()
        first = self._pick(seq, out.logits[0, -1])
        reason = self._emit(seq, [first])
        if reason is not None:
            self.backend.forget_buffers()  # the prefill's cache is freed now
            self._finish(seq, reason)
            return
        r = len(self.rows)
        s = self.col - n
        for dst, src in zip(self._full.buffers(), state.cache.buffers()):
            dst[r, :, s : self.col] = src[0, :, :n]
        self._seen[r] = False
        self._seen[r, s : self.col] = True
        seq.committed, seq.root = n, first
        self.rows.append(seq)
        self._view = None
        self.backend.forget_buffers()

    def _pick(self, seq: _Seq, logits: np.ndarray) -> int:
        sp = seq.config.sampling
        if sp.greedy:
            return int(np.argmax(logits))
        # a seeded request draws as it would alone (Decoder.accept: one stream per position)
        rng = seq.rng if sp.seed is None else position_rng(sp.seed, len(seq.tokens))
        return sample_from(warp_logits(logits, sp.temperature, sp.top_k, sp.top_p), rng)

    def _emit(self, seq: _Seq, tokens: list[int]) -> str | None:
        """Hand tokens to the caller, cut at EOS and the budget; the finish reason once the sequence is done.

        The caller finishes it only after its row has left, so whoever holds a completion sees the row free.
        """
        cut = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        tokens = tokens[: min(cut, seq.remaining)]
        seq.tokens.extend(tokens)
        seq.remaining -= len(tokens)
        st = seq.stats
        st.new_tokens += len(tokens)
        for t in tokens:
            seq.out.put(t)
        if seq.t_join:
            st.decode_s = time.perf_counter() - seq.t_join
        if tokens and tokens[-1] in self.eos:
            return "stop"
        if seq.remaining <= 0 or len(seq.tokens) >= self.limit:
            return "length"
        return None

    # --- one step over the batch ----------------------------------------------------------------
    def _draft(self) -> tuple[int, list[int]]:
        """A lone greedy sequence's lookup chain (matched n-gram size, tokens), sized by its cost curve.

        Rows that accept different numbers of tokens would need their caches to advance by different
        amounts, which the shared write pointer cannot do without leaving a row off the alignment; so two
        or more rows decode plainly, and a batch already reads the weights once for many tokens.
        """
        if not self.draft or len(self.rows) != 1:
            return 0, []
        seq = self.rows[0]
        room = min(self.max_rows - 1, self.limit - len(seq.tokens) - 1, seq.remaining - 1)
        if seq.drafter is None or not seq.config.sampling.greedy or room <= 0:
            return 0, []
        return seq.drafter.chain(np.asarray(seq.tokens), room)

    def _step(self) -> None:
        for seq in [s for s in self.rows if s.cancelled()]:
            self._leave(seq, "cancelled")
        if not self.rows:
            return
        n, chain = self._draft()
        b = len(self.rows)
        t = max(1 + len(chain), self.plan.min_rows)
        if self.col + max(t, 2) > self._full.capacity:
            self._repack(min_col=0, extra=t)
        ids = np.empty((b, t), dtype=np.int64)
        for r, seq in enumerate(self.rows):
            feed = [seq.root] + chain  # chain is empty unless this is the only row
            ids[r, : len(feed)], ids[r, len(feed) :] = feed, feed[-1]
        pos = np.array([seq.committed for seq in self.rows])[:, None] + np.arange(t)
        cap, col = self._full.capacity, self.col
        mask = np.empty((b, 1, t, cap), dtype=self.backend.mask_dtype)
        mask[:] = np.where(self._seen[:b, None, None, :], 0.0, self._neg)
        mask[:, 0, :, col : col + t] = np.where(np.tril(np.ones((t, t), dtype=bool)), 0.0, self._neg)
        if self._view is None:
            self._view = KVCache([k[:b] for k in self._full.keys], [v[:b] for v in self._full.values], 0,
                                 self._full.allocate)
        tb = time.perf_counter()
        out = self.backend.step(StepInputs(ids, pos, mask, np.arange(col, col + t), np.arange(t)), self._view)
        took = time.perf_counter() - tb
        self.steps += 1
        top = out.logits.argmax(-1)  # [b, t]
        advance, done = 1, []
        for r, seq in enumerate(self.rows):
            a = 0
            if seq.config.sampling.greedy:
                while a < len(chain) and top[r, a] == chain[a]:
                    a += 1
                nxt = int(top[r, a])
            else:
                nxt = self._pick(seq, out.logits[r, 0])
            if chain:
                seq.drafter.record(n, a, len(chain))
                advance = 1 + a  # the lone row's root and accepted tokens keep their K/V
            st = seq.stats
            st.steps += 1
            st.backend_s += took
            st.tree_sizes.append(1 + len(chain))
            before = st.new_tokens
            reason = self._emit(seq, chain[:a] + [nxt])
            st.accepted.append(st.new_tokens - before)
            if reason is None:
                self._seen[r, col : col + advance] = True
                seq.committed += advance
                seq.root = nxt
            else:
                done.append((seq, reason))
        self.col = col + advance
        for seq, reason in done:
            self._leave(seq, reason)

    def _leave(self, seq: _Seq, reason: str) -> None:
        """Drop a row (the last row moves into its place, one row's copy), then finish its request."""
        r, last = self.rows.index(seq), len(self.rows) - 1
        if r != last:
            for buf in self._full.buffers():
                buf[r] = buf[last]
            self._seen[r] = self._seen[last]
            self.rows[r] = self.rows[last]
        self.rows.pop()
        self._view = None
        self.backend.forget_buffers()
        self._finish(seq, reason)

    def _repack(self, min_col: int, extra: int = 0) -> None:
        """Move every row's attended columns together, ending at the new write pointer, keeping their alignment.

        Every row's next token index is congruent to the write pointer modulo the period, so the largest
        committed length (or ``min_col``, of the same residue) is a pointer every row can end at.
        """
        end = max([min_col] + [s.committed for s in self.rows])
        need = end + max(extra, self.max_rows, 2) + _HEADROOM
        cap = bucket_for(min(need, self.buckets[-1]), self.buckets)
        new = self.backend.new_cache(self.max_batch, cap)
        seen = np.zeros((self.max_batch, cap), dtype=bool)
        for r, seq in enumerate(self.rows):
            cols = np.flatnonzero(self._seen[r])
            start = end - len(cols)
            for dst, src in zip(new.buffers(), self._full.buffers()):
                dst[r, :, start:end] = src[r][:, cols]
            seen[r, start:end] = True
        self._full, self._seen, self.col = new, seen, end
        self._view = None
        self.backend.forget_buffers()
