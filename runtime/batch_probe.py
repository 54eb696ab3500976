"""Whether a sequence's rows are the same, bit for bit, in a batch as alone: the batch probe.

Continuous batching (:mod:`.batch`) runs every active sequence as one row of the batch dimension of
the bundle's standard-op graph, with one cache whose write columns all rows share. So a sequence's
tokens sit at other cache columns than they would alone, next to other sequences' rows, in a cache of
another capacity. Whether that changes its arithmetic depends on the kernels: measured on an AVX2 EPYC with ONNX
Runtime 1.32, the batch size, the other rows, the capacity and a shift of the columns by a multiple
of 4 change nothing, while a shift by 1 changes the logits by 5e-5 (the attention's vector lanes see
the keys in another order). So nothing is assumed: for each candidate alignment period ``p``
(1, 2, 4, ..., 64) the probe runs one sequence alone (batch 1, from column 0) and the same sequence as
row 0 of a 3-row batch whose other rows hold other text, starting at column ``p``, in a cache of twice
the capacity, with a 2-row chain as its last step (as a lone row's draft is verified).
The smallest ``p`` whose rows agree bit for bit is the batch layout's alignment; the verdict is cached
per machine like the step plan's (:mod:`.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .backends.base import StepInputs
from .plan import PROBE_PROMPT, Candidate, ProbeCheck, ProbeResult, cached_verdict, store_verdict, verdict_key
from .probe import _gap

if TYPE_CHECKING:
    from .backends.base import Backend
    from .bundle import BundleManifest

PERIODS = (1, 2, 4, 8, 16, 32, 64)
_CAPACITY = 128


@dataclass(frozen=True)
class BatchVerdict:
    """The alignment batched rows need to equal a lone row, or None where no period up to 64 does."""

    period: int | None
    results: tuple[ProbeResult, ...]

    @property
    def exact(self) -> bool:
        return self.period is not None

    @property
    def reason(self) -> str:
        if self.period is not None:
            return (f"exact batching: a sequence's rows in a batch equal its rows alone bit for bit when its cache "
                    f"columns keep their alignment modulo {self.period} (probed on this machine).")
        worst = max((c for r in self.results for c in r.checks), key=lambda c: c.max_abs)
        return (f"batched rows differ from a lone sequence's on this machine at every alignment up to "
                f"{PERIODS[-1]} (by {worst.max_abs:.2g})")


def _prompt(manifest: BundleManifest, seed: int, n: int) -> np.ndarray:
    v = manifest.model.vocab_size
    return np.array([(seed + 7919 * i) % v for i in range(n)], dtype=np.int64)


class _Run:
    """Feeds steps to one cache: row r's tokens, each with its own positions and visible columns."""

    def __init__(self, backend: Backend, batch: int, capacity: int):
        self.backend, self.cache = backend, backend.new_cache(batch, capacity)
        self.neg = np.finfo(backend.mask_dtype).min
        self.seen = np.zeros((batch, capacity), dtype=bool)

    def step(self, ids: np.ndarray, pos: np.ndarray, col: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``ids`` [B, T] written at columns col..col+T-1, causal within the step; logits of every row."""
        b, t = ids.shape
        cap = self.cache.capacity
        mask = np.full((b, 1, t, cap), self.neg, dtype=self.backend.mask_dtype)
        mask[:, 0] = np.where(self.seen[:, None, :], 0.0, self.neg)
        for j in range(t):
            mask[:, 0, j, col : col + j + 1] = 0.0
        out = self.backend.step(StepInputs(ids, pos, mask, np.arange(col, col + t), np.arange(t)), self.cache)
        self.seen[:, col : col + t] = True
        return out.logits, out.hidden_states


def _alone(backend: Backend, manifest: BundleManifest, tokens: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The probe sequence alone: prefill, then plain steps t0, t1, t2."""
    run = _Run(backend, 1, _CAPACITY)
    prompt = _prompt(manifest, 17, PROBE_PROMPT)
    n = len(prompt)
    run.step(prompt[None], np.arange(n)[None], 0)
    out = []
    for i, tok in enumerate(tokens[:3]):
        lg, hd = run.step(np.array([[tok]]), np.array([[n + i]]), n + i)
        out.append((lg[0, 0], hd[0, 0]))
    return out


def _batched(backend: Backend, manifest: BundleManifest, tokens: np.ndarray, p: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The same sequence as row 0 of a 3-row batch at column ``p``, then a 2-row chain (a lone row's draft)."""
    n = PROBE_PROMPT
    run = _Run(backend, 3, 2 * _CAPACITY)
    # Row 0's prompt from a lone prefill (as the scheduler does), the others' from a batched one at column p.
    pre = _Run(backend, 1, _CAPACITY)
    pre.step(_prompt(manifest, 17, n)[None], np.arange(n)[None], 0)
    others = np.stack([_prompt(manifest, 17, n), _prompt(manifest, 5, n), _prompt(manifest, 911, n)])
    run.step(others, np.tile(np.arange(n), (3, 1)), p)
    for dst, src in zip(run.cache.buffers(), pre.cache.buffers()):
        dst[0, :, p : p + n] = src[0, :, :n]
    col, out = p + n, []
    lg, hd = run.step(np.array([[tokens[0]], [3], [4]]), np.full((3, 1), n), col)
    out.append((lg[0, 0], hd[0, 0]))
    col += 1
    lg, hd = run.step(np.array([[tokens[1]], [5], [6]]), np.full((3, 1), n + 1), col)
    out.append((lg[0, 0], hd[0, 0]))
    col += 1
    chain = np.array([[tokens[2], tokens[3]], [7, 8], [9, 10]])
    lg, hd = run.step(chain, np.tile(np.array([n + 2, n + 3]), (3, 1)), col)
    out.append((lg[0, 0], hd[0, 0]))
    return out


def probe_batch(backend: Backend, manifest: BundleManifest, use_cache: bool = True) -> BatchVerdict:
    """The smallest alignment period at which batched rows equal lone rows bit for bit (cached per machine)."""
    v = manifest.model.vocab_size
    tokens = np.array([(101 + 104729 * i) % v for i in range(4)], dtype=np.int64)
    alone: list | None = None
    results = []
    for p in PERIODS:
        cand = Candidate(f"batch-align-{p}", False, 1)
        key = verdict_key(backend, manifest, cand, 3)
        res = cached_verdict(key) if use_cache else None
        if res is None:
            alone = alone or _alone(backend, manifest, tokens)
            got = _batched(backend, manifest, tokens, p)
            checks = tuple(ProbeCheck(f"batch row, step {i + 1}", max(_gap(a[0], b[0]), _gap(a[1], b[1])))
                           for i, (a, b) in enumerate(zip(alone, got)))
            res = ProbeResult(cand, checks, 0.0)
            if use_cache:
                store_verdict(key, res)
        results.append(res)
        if res.chains_exact:
            return BatchVerdict(p, tuple(results))
    return BatchVerdict(None, tuple(results))
