"""The step-cost curve measured at load: the cost of a T-row step against a 1-row step, on the decoder's backend.

:class:`~.cost_meter.StepCostMeter` then re-estimates it from the decode loop's own steps.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .kvcache import bucket_for
from .rows import SeqRows, step_inputs
from .tree import DraftTree

if TYPE_CHECKING:
    from .decode import Decoder


def measure_cost_curve(decoder: Decoder, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32), repeats: int = 5,
                       past: int = 256, largest: int | None = None) -> dict[int, float]:
    """Cost of a T-token step relative to a 1-token step, measured on ``decoder``'s backend.

    Sizes up to ``largest`` (the decoder's tree budget if None; never past its plan's rows) are measured.
    Each size runs ``repeats`` chain steps over a scratch cache holding ``past`` tokens (fewer when the
    bundle's context is short), in rounds over the sizes; each round gives every size's cost relative
    to that round's 1-token step, and the median over the rounds counts: a slow spell of the machine
    hits a ratio's two sides alike, and one lucky or unlucky step moves nothing. (Neither this nor the
    fastest run of each size, used before, makes the curve agree between the workers of one bench run:
    2 rows cost 1.07-1.30 of 1 row with the one, 1.12-1.30 with the other, on the AMD EPYC.)
    On a backend that runs 1-row and multi-row steps on different graphs (``OrtBackend`` with a
    GGUF-block graph) the curve has a step between T = 1 and T = 2, which a fixed table cannot know.
    """
    largest = min(largest or decoder.max_tree, decoder.plan.max_rows, decoder.manifest.limits.max_tree)
    sizes = tuple(t for t in sizes if t <= largest) or (1,)
    past = max(1, min(past, decoder.manifest.limits.max_context - sizes[-1]))
    cache = decoder.backend.new_cache(1, bucket_for(min(past + sizes[-1], decoder.buckets[-1]), decoder.buckets))
    cache.length = past
    feeds = {}
    for size in sizes:
        t = max(size, decoder.min_rows)  # what a step of ``size`` nodes runs
        feeds[size] = step_inputs([SeqRows(past, DraftTree.chain([0] * t))], t, cache.capacity,
                                  decoder.backend.mask_dtype)
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

