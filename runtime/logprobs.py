"""Log-probabilities of emitted tokens, from the verify step's rows (``logprobs`` / ``top_logprobs``).

A token's row is the one that chose it: the row of its parent node in the verified tree (the prefill's last
row for the first token). Where the step plan makes a row's logits bit for bit those of a plain step (the
probe's verdict), the log-probabilities equal, bit for bit, what plain decoding of the same bundle reports:
the same float32 row through the same arithmetic. They are the model's own distribution (the logits before
temperature, top-p and top-k), as OpenAI and vLLM report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_TOP = 20  # the most alternatives per token, as OpenAI allows


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at its position, most likely first


def token_logprobs(rows: np.ndarray, tokens: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """Each of ``tokens`` with its log-probability under its row of ``rows`` ``[k, V]`` (logits), and the
    ``top`` most likely tokens of that row (ties: the lower id first)."""
    out = []
    for row, tok in zip(rows, tokens):
        x = np.asarray(row, dtype=np.float32)
        peak = x.max()
        lse = float(peak) + float(np.log(np.exp(x - peak, dtype=np.float32).sum(dtype=np.float64)))
        best: tuple[tuple[int, float], ...] = ()
        if top:
            cut = np.argpartition(-x, top - 1)[:top] if top < x.size else np.arange(x.size)
            order = sorted(cut.tolist(), key=lambda i: (-x[i], i))
            best = tuple((int(i), float(x[i]) - lse) for i in order)
        out.append(TokenLogprob(int(tok), float(x[int(tok)]) - lse, best))
    return out
