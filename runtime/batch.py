"""Continuous batching: every active sequence is one row of one decode step (``load(..., max_batch=N)``).

A scheduler thread owns the backend. Requests wait in arrival order and join at step boundaries: a
joining prompt is prefilled alone (batch 1, as it would be with no one else), its K/V copied into a
free row of the shared cache, and from then on each step runs every active sequence as one row of the
batch dimension of the bundle's batching graph (``BundleManifest.batch_graph``: the base step with a
sequence length per row). A sequence that ends (EOS, its token budget, the context, or its caller went
away) leaves after that step and its row goes to the next request.

**Layout.** Each sequence keeps its token ``i`` at cache column ``i`` of its row, as it does alone: a
step writes every row at its own columns (the batching graph shifts row b's by its position's offset
from row 0's, see ``contract.WRITE_INDICES``) and attends over its own length, and a joining prompt's
K/V is copied into the first columns of a free row. The sums over a sequence's cache columns then meet
its keys in the order they meet them alone (measured on an AMD EPYC with ONNX Runtime 1.32, a sequence
shifted by any number of columns short of 256 computed other logits). What remains (the batch size, the
other rows, the cache's capacity) is probed bit for bit at load (:mod:`.batch_probe`). A greedy request
then gives, token for token, the output it gives alone on this engine.

**Speculation that adapts to load.** With a ``prompt-lookup`` or ``ngram`` draft, a sequence that has
the batch to itself drafts a lookup (or n-gram table) chain, sized by the measured cost of T-row steps,
exactly as alone, where the step plan verifies chains without padding rows (``StepPlan.min_rows`` 1):
ONNX Runtime's attention takes several sequences of one row each, or one sequence of several rows, so
a padded plan's plain steps could not batch, and a sequence's rows must be computed the same way alone
and in a batch. Two or more rows decode plainly: a batch already reads the weights once for many
tokens, and a step of several rows per sequence multiplies its work where the batch is already bound
by arithmetic.
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
_HEADROOM = 128  # spare columns when the cache grows, so that it does not grow every few steps
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
    if manifest.batch_graph() is None:
        return BundleError("The bundle has no batching graph; re-export its base with this specdeploy (--target ort "
                           "or all), or use max_batch 1.")
    return None


def lone_row_drafts(plan: StepPlan) -> bool:
    """Whether a sequence alone in the batch may draft: where the step plan verifies exact chains without
    padding rows, as batched plain steps of one row per sequence run."""
    return plan.speculate and plan.min_rows == 1


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
    """The backend batching runs: ONNX Runtime on the CPU with the bundle's batching graph."""
    from .backends.ort import OrtBackend

    return OrtBackend(bundle_dir, manifest, provider="cpu", threads=threads, graph=manifest.batch_graph())


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

    def __init__(self, backend: Backend, manifest: BundleManifest, plan: StepPlan, max_batch: int,
                 drafter: Callable[[], PromptLookupDrafter] | None = None, lossy: bool = False, min_batch: int = 1):
        self.backend, self.manifest, self.plan = backend, manifest, plan
        backend.forget_buffers()  # the probes' scratch caches are freed: nothing may alias new buffers
        self.max_batch = max_batch
        # A plain step of fewer rows runs with copies of row 0 up to min_batch rows (their outputs dropped), where
        # the batch probe found a lone row computed otherwise than a row of a batch (BatchVerdict.min_batch).
        self.min_batch = min(min_batch, max_batch)
        self.lossy = lossy  # batched rows are not bitwise a lone row's here (allow_inexact)
        self.decoder = Decoder(backend, manifest, None, plan=plan)  # prefills and prompt checks
        self.limit = manifest.limits.max_context
        lone_drafts = drafter is not None and lone_row_drafts(plan)
        self.max_rows = min(plan.max_rows, MAX_DRAFT + 1) if lone_drafts else 1
        self.draft = self.max_rows > 1
        self._new_drafter = drafter  # a lookup drafter per sequence (its state is the sequence's)
        # Capacities in steps of 64 columns, not doublings: the cache holds max_batch rows of fp32 K/V.
        top = self.limit + self.max_rows
        self.buckets = (*range(64, top, 64), top)
        self.eos = frozenset(manifest.model.eos_token_ids)
        self._neg = np.finfo(backend.mask_dtype).min
        self._full = backend.new_cache(max_batch, self.buckets[0])
        self._view: KVCache | None = None  # the first rows of the cache that the next step runs
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
        """Cancelled waiters leave; waiting ones join, oldest first, while a row is free."""
        with self._cv:
            for seq in [s for s in self._waiting if s.cancelled()]:
                self._waiting.remove(seq)
                self._finish(seq, "cancelled")
            while self._waiting and len(self.rows) + len(self._joining) < self.max_batch:
                self._joining.append(self._waiting.popleft())
        joining = self._joining
        if joining:  # room for the longest prompt and the steps ahead: at most one resize for all of them
            self._fit(max(len(s.tokens) for s in joining) + self.max_rows)
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
        for dst, src in zip(self._full.buffers(), state.cache.buffers()):
            dst[r, :, :n] = src[0, :, :n]  # its token i at column i, as alone
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

        Two or more rows decode plainly: a batch already reads the weights once for many tokens, and a
        step of several rows per sequence multiplies its arithmetic.
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
        t = 1 + len(chain)  # a lone row drafts only where plain steps need no padding (lone_row_drafts)
        committed = np.array([seq.committed for seq in self.rows])
        self._fit(int(committed.max()) + t)
        rows = max(b, self.min_batch) if t == 1 else b  # GQA takes several sequences of one row each only
        ids = np.empty((rows, t), dtype=np.int64)
        for r, seq in enumerate(self.rows):
            feed = [seq.root] + chain  # chain is empty unless this is the only row
            ids[r, : len(feed)], ids[r, len(feed) :] = feed, feed[-1]
        ids[b:] = ids[0]  # copies of row 0 in free rows, up to min_batch: written there, dropped after
        committed = np.pad(committed, (0, rows - b), "edge")
        pos = committed[:, None] + np.arange(t)  # [rows, t]: also each row's columns
        visible = np.arange(self._full.capacity)[None, None, :] <= pos[:, :, None]  # its past, causal in the step
        mask = np.where(visible, 0.0, self._neg).astype(self.backend.mask_dtype)[:, None]
        if self._view is None or self._view.keys[0].shape[0] != rows:
            self._view = KVCache([k[:rows] for k in self._full.keys], [v[:rows] for v in self._full.values], 0,
                                 self._full.allocate)
            self.backend.forget_buffers()  # a view of other rows: nothing may alias the last one
        tb = time.perf_counter()
        out = self.backend.step(StepInputs(ids, pos, mask, pos[0], np.arange(t)), self._view)
        took = time.perf_counter() - tb
        self.steps += 1
        top = out.logits.argmax(-1)  # [b, t]
        done = []
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
            st = seq.stats
            st.steps += 1
            st.backend_s += took
            st.tree_sizes.append(1 + len(chain))
            before = st.new_tokens
            reason = self._emit(seq, chain[:a] + [nxt])
            st.accepted.append(st.new_tokens - before)
            if reason is None:
                seq.committed += 1 + a  # the root and the accepted tokens keep their K/V
                seq.root = nxt
            else:
                done.append((seq, reason))
        for seq, reason in done:
            self._leave(seq, reason)

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

    def _fit(self, need: int) -> None:
        """A cache of at least ``need`` columns: grown (rows copied) when it has fewer, and re-sized to fit the
        coming prompts when the batch is empty (a capacity that earlier requests needed would hold memory and
        widen every step's mask)."""
        if self.rows and need <= self._full.capacity:
            return
        cap = bucket_for(min(need + (_HEADROOM if self.rows else 0), self.buckets[-1]), self.buckets)
        if not self.rows and cap == self._full.capacity:
            return
        new = self.backend.new_cache(self.max_batch, cap)
        for r, seq in enumerate(self.rows):
            for dst, src in zip(new.buffers(), self._full.buffers()):
                dst[r, :, : seq.committed] = src[r, :, : seq.committed]
        self._full = new
        self._view = None
        self.backend.forget_buffers()
