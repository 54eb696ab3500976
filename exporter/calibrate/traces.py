"""Decode traces of a draft on held-in prompts, and the speed model that scores a tree or gate on them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Trace:
    """One greedy generation: ``ref[s]`` is token s; ``hidden[s]`` the base hidden state that produced it."""

    ref: np.ndarray  # [S+1] int64 (the last token has no hidden row: no step followed it)
    hidden: np.ndarray  # [S, H] float32
    entropy: np.ndarray  # [S] float64, of the base distribution that produced ref[s]
    max_logp: np.ndarray  # [S] float64
    ids: np.ndarray | None = None  # [S, K, k] heads top-k ids at every position
    logp: np.ndarray | None = None  # [S, K, k]


def entropy_features(logits: np.ndarray) -> tuple[float, float]:
    x = logits.astype(np.float64) - float(np.max(logits))
    p = np.exp(x)
    z = p.sum()
    return float(np.log(z) - (p * x).sum() / z), float(-np.log(z))


def simulate(accepts: list[np.ndarray], drafts: list[np.ndarray], cost_ar: float, cost_spec: float,
             cost_gate: float) -> tuple[float, float, float]:
    """Walk each trace as the loop does; return (tokens/s, tau, fraction of steps drafted)."""
    tokens = seconds = steps = drafted = 0.0
    for acc, dr in zip(accepts, drafts):
        s, n = 0, acc.shape[0]
        while s < n:
            if dr[s]:
                adv = 1 + int(acc[s])
                seconds += cost_spec + cost_gate
                drafted += 1
            else:
                adv = 1
                seconds += cost_ar + cost_gate
            adv = min(adv, n - s)
            tokens += adv
            steps += 1
            s += adv
    return tokens / seconds, tokens / steps, drafted / steps
