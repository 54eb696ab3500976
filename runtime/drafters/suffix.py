"""Suffix drafting, in the spirit of SuffixDecoding (arXiv 2411.04975): continue the current context's
longest suffix seen before, in this request or in earlier requests' outputs.

Two count tries of bounded depth hold every substring of at most ``depth`` tokens with the number of
times it occurred: one over this request's prompt and output, grown token by token, and one shared
cache of recent outputs (:class:`SuffixCache`, one per engine, so a server shares it across requests
and a template that many users fill is learned once). The cache keeps at most ``max_tokens`` tokens of
outputs, evicting the oldest whole output (its counts are taken back out of the trie, so memory stays
flat however many requests pass), and may isolate its contents per namespace (an API key).

At each step the drafter matches the context's longest suffix in each trie and expands the matched
node's continuations best first, each node weighted by its path's empirical frequency (the share of
the occurrences that continued that way, one unseen continuation counted in at the match) times a calibration
learned online from what its drafts earned, per trie and match length (1, 2, 3, 4-7, 8+ tokens); the
evidence of a bucket that is not drafting fades towards its prior, so it is tried again later. It keeps the number of nodes (0 included: a plain step) with the most expected tokens per
unit of step cost on the backend's cost curve, so the draft's size follows the curve. Where the step
plan verifies trees it drafts several branches; elsewhere the best chain. Verification keeps greedy
output identical to plain decoding whatever is drafted.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np

from ..tree import DraftTree
from ..tree_cost import CPU_COST_CURVE, step_cost
from .base import DraftContext, Drafter
from .kinds import SUFFIX

DEPTH = 16  # longest substring a trie holds: the longest match plus its drafted continuation
MAX_DRAFT = 16  # nodes a draft may add to the root
MIN_SHARE = 0.02  # a branch whose path frequency falls below this is not expanded
CACHE_TOKENS = 16_384  # the shared cache's default size, in output tokens (about 64 long answers)
MIN_MATCH = (1, 2)  # the shortest match drafted from, in this request's trie and in the shared cache (whose
# 1-token matches fan out to hundreds of continuations and seldom pay)
BUCKET_LOWS = (1, 2, 3, 4, 8)  # match lengths calibrated apart: 1, 2, 3, 4-7, 8+ tokens
BUCKETS = ("1", "2", "3", "4-7", "8+")
PRIOR = (2.0, 3.0)  # a bucket's calibration before evidence: 2 of 3 expected tokens accepted
FORGET = 0.99  # per step a match does not draft, its bucket's evidence fades by this much towards the prior


class _Node:
    __slots__ = ("count", "kids")

    def __init__(self) -> None:
        self.count = 0
        self.kids: dict[int, _Node] = {}


class SuffixTrie:
    """Every substring of at most ``depth`` tokens of the sequences added, with its count of occurrences."""

    def __init__(self, depth: int = DEPTH):
        if depth < 2:
            raise ValueError("a suffix trie needs a depth of at least 2")
        self.depth = depth
        self.root = _Node()
        self.nodes = 0  # nodes below the root (what memory grows with)
        self._open: list[tuple[_Node, int]] = []  # extend(): the substrings ending at the last token

    def extend(self, token: int) -> None:
        """Append ``token`` to the sequence being grown: count each substring that now ends with it."""
        still = []
        for node, d in [*self._open, (self.root, 0)]:
            kid = node.kids.get(token)
            if kid is None:
                kid = node.kids[token] = _Node()
                self.nodes += 1
            kid.count += 1
            if d + 1 < self.depth:
                still.append((kid, d + 1))
        self._open = still

    def end(self) -> None:
        """The sequence being grown has ended: the next :meth:`extend` starts a new one."""
        self._open = []

    def add(self, tokens: Sequence[int]) -> None:
        """Count every substring of ``tokens`` (of at most ``depth`` tokens)."""
        self.end()
        for tok in tokens:
            self.extend(int(tok))
        self.end()

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back what :meth:`add` counted for ``tokens``; nodes left with no count are freed."""
        toks = [int(t) for t in tokens]
        for start in range(len(toks)):
            node = self.root
            for tok in toks[start : start + self.depth]:
                kid = node.kids[tok]
                kid.count -= 1
                if kid.count == 0:  # nothing below it was counted more often: free the whole branch
                    del node.kids[tok]
                    self.nodes -= _size(kid)
                    break
                node = kid

    def find(self, context: Sequence[int]) -> tuple[int, _Node | None]:
        """The longest suffix of ``context`` (at most ``depth - 1`` tokens) that occurred and was followed
        by something: (its length, its node); (0, None) if none was. A substring's suffixes occurred
        whenever it did, so the longest is found by bisection."""
        lo, hi = 0, min(len(context), self.depth - 1)
        while lo < hi:  # the longest m whose suffix occurred
            mid = (lo + hi + 1) // 2
            if self._walk(context[len(context) - mid :]) is None:
                hi = mid - 1
            else:
                lo = mid
        for m in range(lo, 0, -1):  # the longest of those that something followed
            node = self._walk(context[len(context) - m :])
            if node is not None and node.kids:
                return m, node
        return 0, None

    def _walk(self, tokens: Sequence[int]) -> _Node | None:
        node = self.root
        for tok in tokens:
            node = node.kids.get(int(tok))
            if node is None:
                return None
        return node


def _size(node: _Node) -> int:
    n, stack = 1, list(node.kids.values())
    while stack:
        cur = stack.pop()
        n += 1
        stack.extend(cur.kids.values())
    return n


class SuffixCache:
    """Recent outputs shared across requests: a :class:`SuffixTrie` per namespace over at most
    ``max_tokens`` tokens in all, the oldest output evicted first. Thread-safe."""

    def __init__(self, max_tokens: int = CACHE_TOKENS, depth: int = DEPTH):
        if max_tokens < 0:
            raise ValueError("the suffix cache's size must be 0 (off) or more tokens")
        self.max_tokens, self.depth = max_tokens, depth
        self.tokens = 0
        self._tries: dict[str, SuffixTrie] = {}
        self._order: deque[tuple[str, tuple[int, ...]]] = deque()  # (namespace, output), oldest first
        self.lock = threading.Lock()

    @property
    def nodes(self) -> int:
        return sum(t.nodes for t in self._tries.values())

    def add(self, tokens: Sequence[int], namespace: str = "") -> None:
        """Remember an output (the longest ones are cut to the cache's size), evicting the oldest."""
        out = tuple(int(t) for t in tokens)[-self.max_tokens :] if self.max_tokens else ()
        if len(out) < 2:
            return
        with self.lock:
            while self._order and self.tokens + len(out) > self.max_tokens:
                ns, old = self._order.popleft()
                self._tries[ns].remove(old)
                self.tokens -= len(old)
                if not self._tries[ns].nodes:
                    del self._tries[ns]
            self._tries.setdefault(namespace, SuffixTrie(self.depth)).add(out)
            self._order.append((namespace, out))
            self.tokens += len(out)

    def trie(self, namespace: str = "") -> SuffixTrie | None:
        return self._tries.get(namespace)


class SuffixDrafter(Drafter):
    kind = SUFFIX

    def __init__(self, cache: SuffixCache | None = None, depth: int = DEPTH, max_draft: int = MAX_DRAFT,
                 chains: bool = False, cost_curve: Mapping[int, float] = CPU_COST_CURVE, local: bool = True):
        self.cache = cache if cache is not None else SuffixCache(depth=depth)
        self.depth, self.max_draft, self.chains = depth, max_draft, chains
        self.local = local  # False: the shared cache alone (``auto``, whose prompt lookup covers the context)
        self.namespace = ""  # the cache's namespace for the next generations (an API key, or "" for all)
        # per (trie, match-length bucket): tokens accepted, tokens the frequencies expected (prior 2/3)
        self._calib = {(t, b): [*PRIOR] for t in range(2) for b in range(len(BUCKETS))}
        self._drafted: tuple[int, int] | None = None  # the (trie, bucket) the last draft came from
        self.use_cost_curve(cost_curve)
        self.reset()

    @property
    def needs_cost_curve(self) -> bool:
        return True

    def use_cost_curve(self, cost_curve: Mapping[int, float]) -> None:
        self._cost = [step_cost(cost_curve, n) for n in range(1, self.max_draft + 2)]

    def reset(self) -> None:
        self._local = SuffixTrie(self.depth)
        self._seen: list[int] = []
        self._prompt_len: int | None = None
        self._expected = 0.0  # what the frequencies expected of the last draft

    def finished(self, tokens: Sequence[int], prompt_len: int) -> None:
        self.cache.add(list(tokens)[prompt_len:], self.namespace)

    def _follow(self, tokens: np.ndarray) -> list[int]:
        """Grow the local trie to ``tokens`` (which extend what was seen, else start over); the last
        token, the root, is not yet in it, so that the context's own end never matches itself."""
        seen = self._seen
        if len(tokens) < len(seen) + 1 or (seen and int(tokens[len(seen) - 1]) != seen[-1]):
            self._local = SuffixTrie(self.depth)
            seen.clear()
        for tok in tokens[len(seen) : len(tokens) - 1].tolist():
            self._local.extend(tok)
            seen.append(tok)
        return seen

    def _expand(self, node, budget: int) -> tuple[list[int], list[int], list[float]]:
        """The matched node's continuations best first: node tokens, parents (-1: the root), path shares."""
        toks: list[int] = []
        parents: list[int] = []
        shares: list[float] = []
        heap: list[tuple[float, int, int, int, _Node]] = []
        order = 0

        def push(parent: int, nd: _Node, share: float) -> None:
            nonlocal order
            total = sum(k.count for k in nd.kids.values())
            kids = nd.kids.items()
            if self.chains and nd.kids:  # a chain: only the most frequent continuation
                kids = [max(kids, key=lambda kv: kv[1].count)]
            unseen = 1 if parent < 0 else 0  # at the match, one unseen continuation: one occurrence is weak evidence
            for tok, kid in kids:
                p = share * kid.count / (total + unseen)
                if p >= MIN_SHARE:
                    heapq.heappush(heap, (-p, order, parent, tok, kid))
                    order += 1

        push(-1, node, 1.0)
        while heap and len(toks) < budget:
            neg, _, parent, tok, kid = heapq.heappop(heap)
            toks.append(tok)
            parents.append(parent)
            shares.append(-neg)
            push(len(toks) - 1, kid, -neg)
        return toks, parents, shares

    def _best(self, node, budget: int, key: tuple[int, int]) -> tuple[float, list[int], list[int], list[float]]:
        """The prefix of the best-first expansion with the most expected tokens per unit of step cost."""
        toks, parents, shares = self._expand(node, budget)
        acc, exp = self._calib[key]
        rate = min(1.0, acc / exp)
        best_n, best_v, expected = 0, 1.0 / self._cost[0], 1.0
        for n, s in enumerate(shares, start=1):
            expected += rate * s
            value = expected / self._cost[n]
            if value > best_v:
                best_n, best_v = n, value
        return best_v, toks[:best_n], parents[:best_n], shares[:best_n]

    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens = np.asarray(ctx.tokens, dtype=np.int64)
        root = int(tokens[-1])
        seen = self._follow(tokens) if self.local else tokens[-self.depth : -1].tolist()
        budget = min(ctx.max_nodes - 1, self.max_draft)
        self._expected, plain = 0.0, 1.0 / self._cost[0]
        if budget < 1:
            return DraftTree.root(root).priced(plain)
        context = [*seen[-(self.depth - 1) :], root]
        best, used, matched = (1.0 / self._cost[0], [], [], []), None, []
        with self.cache.lock:
            for t, trie in enumerate((self._local if self.local else None, self.cache.trie(self.namespace))):
                if trie is None:
                    continue
                m, node = trie.find(context)
                if node is not None and m >= MIN_MATCH[t]:
                    key = (t, _bucket(m))
                    matched.append(key)
                    cand = self._best(node, budget, key)
                    if cand[0] > best[0]:
                        best, used = cand, key
        value, toks, parents, shares = best
        self._drafted = used if toks else None
        for key in matched:  # evidence that kept a match from drafting fades, so it is tried again later
            if key != self._drafted:
                acc, exp = self._calib[key]
                self._calib[key] = [PRIOR[0] + (acc - PRIOR[0]) * FORGET, PRIOR[1] + (exp - PRIOR[1]) * FORGET]
        if not toks:
            return DraftTree.root(root).priced(value)
        self._expected = float(sum(shares))
        return DraftTree(np.array([root, *toks], dtype=np.int64), np.array([-1, *(p + 1 for p in parents)]),
                         value=value)

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        if self._drafted is not None:  # what the frequencies promised against what verification kept
            calib = self._calib[self._drafted]
            calib[0] += len(nodes) - 1
            calib[1] += self._expected

    def profile(self) -> dict:
        rates = {f"{'local' if t == 0 else 'cache'}:{BUCKETS[b]}": round(a / e, 3)
                 for (t, b), (a, e) in self._calib.items()}
        return {"suffix_cache_tokens": self.cache.tokens, "suffix_cache_nodes": self.cache.nodes,
                "suffix_calibration": rates}


def _bucket(match: int) -> int:
    """The calibration bucket of a match of ``match`` tokens (:data:`BUCKETS`)."""
    return next(i for i, low in reversed(list(enumerate(BUCKET_LOWS))) if match >= low)
