"""Whether a sequence's rows are the same, bit for bit, in a batch as alone: the batch probe.

Continuous batching (:mod:`.batch`) runs every active sequence as one row of the batch dimension of
the bundle's batching graph. Each sequence keeps its tokens at the cache columns they hold alone, so
what differs from a lone run is the batch size, the other rows beside it and the cache's capacity
(the batch's longest sequence sets it). Whether any of that changes a row's arithmetic is the kernels'
business, so nothing is assumed: the probe runs one sequence alone (batch 1, a cache just large enough)
and the same sequence as row 0 of a 3-row batch whose other rows hold other text of other lengths, in a
cache of another capacity, then as the batch's only row: with a 2-row chain where a lone row drafts (as
the scheduler verifies its draft), else a plain step. The context is long enough to cross 256 columns, where ONNX Runtime's matrix
products block their sums. Every logit and hidden state must agree bit for bit; the verdict is cached
per machine like the step plan's (:mod:`.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .backends.base import StepInputs
from .kvcache import KVCache
from .plan import Candidate, ProbeCheck, ProbeResult, cached_verdict, store_verdict, verdict_key
from .probe import _gap

if TYPE_CHECKING:
    from .backends.base import Backend
    from .bundle import BundleManifest

PROBE_CONTEXT = 300  # tokens of the probed sequence's prompt (fewer where the bundle's context is shorter)
_OTHERS = (-37, 23)  # the other rows' prompt lengths, against the probed one's


@dataclass(frozen=True)
class BatchVerdict:
    """Whether batched rows equal a lone row bit for bit on this machine, with the probe's checks; ``min_batch``:
    the rows a lone sequence's plain step runs as (2: with a dropped copy of its row)."""

    exact: bool
    results: tuple[ProbeResult, ...]
    min_batch: int = 1

    @property
    def reason(self) -> str:
        if self.exact:
            padded = (" once a lone sequence's plain steps run as two rows (this machine's kernels compute one row "
                      "otherwise)" if self.min_batch > 1 else "")
            return (f"exact batching: a sequence's rows in a batch equal its rows alone bit for bit{padded} (probed "
                    "on this machine).")
        worst = max((c for r in self.results for c in r.checks), key=lambda c: c.max_abs)
        return f"batched rows differ from a lone sequence's on this machine (by {worst.max_abs:.2g} at {worst.what})"


def _prompt(manifest: BundleManifest, seed: int, n: int) -> np.ndarray:
    v = manifest.model.vocab_size
    return np.array([(seed + 7919 * i) % v for i in range(n)], dtype=np.int64)


def _step(backend: Backend, cache: KVCache, ids: np.ndarray, past: np.ndarray, min_batch: int = 1):
    """Rows ``ids`` [B, T] after ``past[b]`` tokens each, at columns (and positions) past[b]..past[b]+T-1; a plain
    step of fewer than ``min_batch`` rows gets copies of row 0 (in the cache's next rows) up to it."""
    b, t = ids.shape
    if t == 1 and b < min_batch:
        ids, past = np.concatenate([ids, np.repeat(ids[:1], min_batch - b, 0)]), np.pad(past, (0, min_batch - b), "edge")
    if cache.keys[0].shape[0] != len(ids):  # a step of fewer rows than the cache holds: its first rows
        cache = _rows(cache, len(ids))
    pos = past[:, None] + np.arange(t)
    visible = np.arange(cache.capacity)[None, None, :] <= pos[:, :, None]
    mask = np.where(visible, 0.0, np.finfo(backend.mask_dtype).min).astype(backend.mask_dtype)[:, None]
    out = backend.step(StepInputs(ids, pos, mask, pos[0], np.arange(t)), cache)
    return out.logits, out.hidden_states


def _rows(cache: KVCache, n: int) -> KVCache:
    """The first ``n`` rows of ``cache``, as a cache of its own (the same buffers)."""
    return KVCache([k[:n] for k in cache.keys], [v[:n] for v in cache.values], 0, cache.allocate)


def _join(backend: Backend, manifest: BundleManifest, cache: KVCache, row: int, seed: int, n: int) -> None:
    """An ``n``-token prompt prefilled alone and copied into ``row`` of ``cache``, as the scheduler joins one."""
    alone = backend.new_cache(1, n + 8)
    _step(backend, alone, _prompt(manifest, seed, n)[None], np.array([0]))
    for dst, src in zip(cache.buffers(), alone.buffers()):
        dst[row, :, :n] = src[0, :, :n]
    backend.forget_buffers()


def _alone(backend: Backend, manifest: BundleManifest, tokens: np.ndarray, n: int, min_batch: int) -> list[tuple]:
    """The probe sequence alone: prefill (copied into a cache of ``min_batch`` rows), then plain steps t0, t1, t2."""
    cache = backend.new_cache(min_batch, n + 8)
    _join(backend, manifest, cache, 0, 17, n)
    out = []
    for i, tok in enumerate(tokens[:3]):
        lg, hd = _step(backend, cache, np.array([[tok]]), np.array([n + i]), min_batch)
        out.append((lg[0, 0], hd[0, 0]))
    backend.forget_buffers()
    return out


def _batched(backend: Backend, manifest: BundleManifest, tokens: np.ndarray, n: int, chains: bool,
             min_batch: int) -> list[tuple]:
    """The same sequence as row 0 of a 3-row batch (each prompt prefilled alone and copied in, as the scheduler
    does), then the batch's only row: verifying a 2-row chain (t2 and a draft token), or plain."""
    lengths = np.array([n, *(n + d for d in _OTHERS)])
    cache = backend.new_cache(3, 2 * (n + 64))
    for r, (seed, m) in enumerate(zip((17, 5, 911), lengths)):
        _join(backend, manifest, cache, r, seed, int(m))
    out = []
    for i in range(2):
        lg, hd = _step(backend, cache, np.array([[tokens[i]], [3 + i], [5 + i]]), lengths + i)
        out.append((lg[0, 0], hd[0, 0]))
    backend.forget_buffers()
    lg, hd = _step(backend, cache, np.array([tokens[2:4] if chains else tokens[2:3]]), np.array([n + 2]), min_batch)
    out.append((lg[0, 0], hd[0, 0]))
    backend.forget_buffers()
    return out


def probe_batch(backend: Backend, manifest: BundleManifest, chains: bool = True, use_cache: bool = True
                ) -> BatchVerdict:
    """Whether batched rows equal lone rows bit for bit on this machine (cached per machine), with a lone
    sequence's plain steps as one row, else as two; ``chains``: with a lone row's chain verified (where lone
    rows draft)."""
    v = manifest.model.vocab_size
    tokens = np.array([(101 + 104729 * i) % v for i in range(4)], dtype=np.int64)
    n = max(8, min(PROBE_CONTEXT, manifest.limits.max_context - max(_OTHERS) - 8))
    results = []
    for min_batch in (1, 2):
        cand = Candidate(f"batch-rows-{n}{'-chains' if chains else ''}{'-lone2' if min_batch > 1 else ''}", False, 1)
        key = verdict_key(backend, manifest, cand, 3)
        res = cached_verdict(key) if use_cache else None
        if res is None:
            alone = _alone(backend, manifest, tokens, n, min_batch)
            got = _batched(backend, manifest, tokens, n, chains, min_batch)
            checks = tuple(ProbeCheck(f"batch row, step {i + 1}", max(_gap(a[0], b[0]), _gap(a[1], b[1])))
                           for i, (a, b) in enumerate(zip(alone, got)))
            res = ProbeResult(cand, checks, 0.0)
            if use_cache:
                store_verdict(key, res)
        results.append(res)
        if res.chains_exact:
            return BatchVerdict(True, tuple(results), min_batch)
    return BatchVerdict(False, tuple(results))
