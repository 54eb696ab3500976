"""Prompt-lookup drafting: continue the longest n-gram suffix that already occurred in the context.

No training and no model: the candidates are what followed earlier occurrences of the current
suffix in the prompt and the generated text. Several matches become the branches of a trie-shaped
tree, most recent match first.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..tree import DraftTree
from .base import DraftContext, Drafter


class PromptLookupDrafter(Drafter):
    kind = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 10, branches: int = 2,
                 max_nodes: int | None = None):
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_tokens, self.branches = num_tokens, branches
        self.max_nodes = max_nodes

    def _continuations(self, tokens: np.ndarray, length: int) -> list[np.ndarray]:
        """Up to ``branches`` distinct continuations of the longest matching suffix, most recent first."""
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            windows = sliding_window_view(tokens[:-1], n)  # [L-n, n]: every earlier n-gram
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size == 0:
                continue
            out: list[np.ndarray] = []
            seen: set[tuple[int, ...]] = set()
            for start in hits[::-1]:
                cont = tokens[start + n : start + n + length]
                key = tuple(cont.tolist())
                if cont.size == 0 or key in seen:
                    continue
                seen.add(key)
                out.append(cont)
                if len(out) == self.branches:
                    break
            if out:
                return out
        return []

    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens = np.asarray(ctx.tokens, dtype=np.int64)
        budget = min(ctx.max_nodes, self.max_nodes or ctx.max_nodes) - 1
        conts = self._continuations(tokens, min(self.num_tokens, budget)) if budget > 0 else []
        # Merge the continuations into a trie rooted at the current token.
        node_tokens, parents = [int(tokens[-1])], [-1]
        children: dict[tuple[int, int], int] = {}
        for cont in conts:
            cur = 0
            for tok in cont.tolist():
                nxt = children.get((cur, tok))
                if nxt is None:
                    if len(node_tokens) > budget:
                        break
                    nxt = len(node_tokens)
                    node_tokens.append(tok)
                    parents.append(cur)
                    children[(cur, tok)] = nxt
                cur = nxt
        return DraftTree(tokens=np.array(node_tokens, dtype=np.int64), parents=np.array(parents, dtype=np.int64))
