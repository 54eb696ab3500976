"""Prompt-lookup drafting: continue the longest n-gram suffix that already occurred in the context.

No training and no model: the candidates are what followed earlier occurrences of the current
suffix in the prompt and the generated text. Several matches become the branches of a trie-shaped
tree, most recent match first.

The draft length adapts: the drafter keeps, per matched n-gram size, two Beta estimates, the chance
that a match's first drafted token is accepted and the chance that a drafted token is accepted given
the one before it was, and drafts the length (0 included) that maximises expected tokens per unit of
step cost (from the backend's cost curve). Lookup acceptance is bimodal (a match either continues for
a while or is wrong at once), which one per-token rate cannot describe: with a single rate, long
right matches made every match look good, and on a backend whose multi-row steps cost much more than
a 1-row step (int4: T = 8 costs ~2.5 plain steps) drafting lost 16% against plain decoding. A poor
match therefore costs a plain step, not a 10-token one.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..tree import DraftTree
from ..tree_cost import CPU_COST_CURVE, step_cost
from .base import DraftContext, Drafter
from .kinds import PROMPT_LOOKUP


class ChainAcceptance:
    """Beta estimates of a draft source's acceptance along a chain: the chance that its first drafted
    token is accepted, and that a later one is, given the one before was. Optimistic priors
    (2 accepted, 1 rejected), so a new source gets tried."""

    def __init__(self) -> None:
        self.first = [2.0, 1.0]  # [accepted, rejected]
        self.later = [2.0, 1.0]

    def expected_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """Expected tokens of a step drafting L tokens, for each L: 1 + p1 (1 + a + ... + a^(L-1))."""
        lengths = np.asarray(lengths)
        return np.asarray(self.expected_up_to(int(lengths.max(initial=0))))[lengths]

    def expected_up_to(self, longest: int) -> list[float]:
        """The expected tokens of drafting L = 0..``longest`` tokens, in plain Python (once per drafted step:
        small numpy calls cost several microseconds each right after a step, see verify._chain_accept)."""
        p1, a = self.first[0] / sum(self.first), self.later[0] / sum(self.later)
        out, partial = [1.0], 0.0
        for j in range(longest):
            partial += a**j
            out.append(1.0 + p1 * partial)
        return out

    def update(self, accepted: int, drafted: int) -> None:
        """``accepted`` of the ``drafted`` chain tokens were accepted."""
        if accepted == 0:
            self.first[1] += 1
        else:
            self.first[0] += 1
            self.later[0] += accepted - 1
            self.later[1] += 1 if accepted < drafted else 0  # the first rejected position, if any


class PromptLookupDrafter(Drafter):
    kind = PROMPT_LOOKUP

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 10, branches: int = 2,
                 max_nodes: int | None = None, cost_curve: Mapping[int, float] = CPU_COST_CURVE,
                 adaptive: bool = True):
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_tokens, self.branches = num_tokens, branches
        self.max_nodes = max_nodes
        self.adaptive = adaptive
        self.use_cost_curve(cost_curve)
        self.reset()

    @property
    def needs_cost_curve(self) -> bool:
        return self.adaptive  # its draft length trades expected tokens against step cost

    def use_cost_curve(self, cost_curve: Mapping[int, float]) -> None:
        """Cost of a T-token step relative to a 1-token step (e.g. measured on the backend in use)."""
        self._cost = [step_cost(cost_curve, n) for n in range(1, self.num_tokens * self.branches + 2)]
        self._lengths = {}

    def reset(self) -> None:
        # Per n-gram size, the acceptance of its matches along the accepted branch.
        self._stats = {n: ChainAcceptance() for n in range(self.min_ngram, self.max_ngram + 1)}
        self._lengths: dict[int, int] = {}  # per n-gram size, the chain length the stats give
        self._last: tuple[int, int] | None = None  # (n-gram size, drafted depth) of the last proposal
        # The context seen so far and an index of its n-grams (n-gram -> start positions, oldest
        # first), grown by the new tokens each step instead of scanning the whole context.
        self._seen: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # every n-gram ending before this position is in the index

    def _length(self, n: int) -> int:
        """Chain length with the most expected tokens per unit of step cost, for matches of size n."""
        if not self.adaptive:
            return self.num_tokens
        length = self._lengths.get(n)
        if length is None:  # L = 0 is a plain step; the first best length on ties
            expected = self._stats[n].expected_up_to(self.num_tokens)
            values = [e / c for e, c in zip(expected, self._cost)]
            length = self._lengths[n] = values.index(max(values))
        return length

    @property
    def last_match(self) -> tuple[int, int] | None:
        """(matched n-gram size, drafted depth) of the last proposal, or None when it drafted nothing."""
        return self._last

    def expected_tokens(self, n: int, length: int) -> float:
        """Expected tokens of a step that drafts ``length`` tokens from a match of size ``n``."""
        return self._stats[n].expected_up_to(length)[length]

    def worth(self, n: int | None, drafted: int, rows: int) -> float:
        """Expected tokens per unit of step cost of a ``rows``-row step drafting ``drafted`` tokens from a
        match of size ``n`` (None: no match, a plain step's expected 1.0 token)."""
        return (self.expected_tokens(n, drafted) if n else 1.0) / self.step_cost(rows)

    def step_cost(self, rows: int) -> float:
        """Cost of a step of ``rows`` rows relative to a 1-row step (the cost curve in use)."""
        return float(self._cost[min(max(rows, 1), len(self._cost)) - 1])

    def _follow(self, tokens: np.ndarray) -> list[int]:
        """Bring the n-gram index up to ``tokens`` (which extends what was seen, else start over)."""
        seen = self._seen
        if len(tokens) < len(seen) or (seen and int(tokens[len(seen) - 1]) != seen[-1]):
            seen.clear()
            self._index.clear()
            self._indexed = 0
        seen.extend(tokens[len(seen):].tolist())
        # Index the n-grams ending at positions indexed .. L-2: the suffix itself (ending at L-1) is
        # what is looked up, so it must not match itself.
        index, last = self._index, len(seen) - 1
        for end in range(self._indexed, last):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                start = end - n + 1
                index.setdefault(tuple(seen[start : end + 1]), []).append(start)
        self._indexed = max(self._indexed, last)
        return seen

    def _continuations(self, tokens: np.ndarray) -> tuple[int, list[list[int]]]:
        """The matched n-gram size and up to ``branches`` distinct continuations, most recent first."""
        seen = self._follow(tokens)
        n_tok = len(seen)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            length = self._length(n)
            if length == 0:
                continue
            out: list[list[int]] = []
            distinct: set[tuple[int, ...]] = set()
            for start in reversed(self._index.get(tuple(seen[n_tok - n :]), ())):
                cont = seen[start + n : start + n + length]
                key = tuple(cont)
                if not cont or key in distinct:
                    continue
                distinct.add(key)
                out.append(cont)
                if len(out) == self.branches:
                    break
            if out:
                return n, out
        return 0, []

    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens = np.asarray(ctx.tokens, dtype=np.int64)
        budget = min(ctx.max_nodes, self.max_nodes or ctx.max_nodes) - 1
        n, conts = self._continuations(tokens) if budget > 0 else (0, [])
        self._last = (n, max(len(c) for c in conts)) if conts else None
        tree = self._trie(int(tokens[-1]), conts, budget)
        # Priced as its main path: the chain the length rule chose, its expected tokens per unit of its step cost (a
        # plain step's when it found nothing). A second match adds rows and chances both; pricing the trie's rows
        # against the main path's chances alone read it below what it earned, and other sources won its steps.
        depth = tree.main_path().num_nodes - 1
        return tree.priced(self.worth(n if conts else None, depth, depth + 1))

    @staticmethod
    def _trie(root: int, conts: list[list[int]], budget: int) -> DraftTree:
        """The continuations merged into a trie under ``root``, at most ``budget`` nodes below it."""
        if len(conts) <= 1:  # one match (or none): the trie is a chain
            return DraftTree.chain([root, *(conts[0][:budget] if conts else ())])
        node_tokens, parents = [root], [-1]
        children: dict[tuple[int, int], int] = {}
        for cont in conts:
            cur = 0
            for tok in cont:
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

    def chain(self, tokens: np.ndarray, max_len: int) -> tuple[int, list[int]]:
        """The most recent match's continuation as one chain of at most ``max_len`` tokens, with the
        matched n-gram size (0 and [] when nothing pays): continuous batching's per-row draft."""
        n, conts = self._continuations(np.asarray(tokens, dtype=np.int64)) if max_len > 0 else (0, [])
        return (n, conts[0][:max_len]) if conts else (0, [])

    def record(self, n: int, accepted: int, drafted: int) -> None:
        """``accepted`` of ``drafted`` chain tokens from a match of size ``n`` were accepted."""
        self._stats[n].update(accepted, drafted)
        self._lengths.pop(n, None)

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        if self._last is None:
            return
        n, depth = self._last
        self._stats[n].update(len(nodes) - 1, depth)  # drafted tokens accepted along the best branch
        self._lengths.pop(n, None)
