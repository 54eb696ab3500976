"""Suffix drafting, in the spirit of SuffixDecoding (arXiv 2411.04975): continue the current context's
longest suffix seen before, in this request or in earlier requests' outputs.

Two count tries of bounded depth hold every substring of at most ``depth`` tokens with the number of
times it occurred: one over this request's prompt and output, grown token by token, and one shared
cache of recent outputs (:class:`SuffixCache`, one per engine, so a server shares it across requests
and a template that many users fill is learned once). The cache keeps at most ``max_tokens`` tokens of
outputs, evicting the oldest whole output (its counts are taken back out of the trie, so memory stays
flat however many requests pass), and may isolate its contents per namespace (an API key).

At each step the drafter matches the context's longest suffix in each trie (of at most half the depth, so
that the other half holds a continuation) and expands the matched node's continuations best first, each node
weighted by its path's empirical frequency (the share of the occurrences that continued that way, one unseen
continuation counted in at the match) times a calibration learned online from what its drafts earned, per trie
and match length (1, 2, 3, 4-7, 8+ tokens), the product at most 1; the evidence of a bucket that is not drafting
fades towards its prior, so it is tried again later. It keeps the number of nodes (0 included: a plain step)
with the most expected tokens per
unit of step cost on the backend's cost curve, so the draft's size follows the curve. A match is priced
before it is expanded (shares only shrink along the expansion, so its best continuation's share bounds what
every draft from it is worth): one that cannot pay, or cannot beat what ``auto``'s lookup proposes, is not
expanded, and the answer and what is learned stay the same. Where the step
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
# The longest suffix matched, as a share of the depth: a trie holds nothing deeper than ``depth`` tokens below its
# root, so a match of ``m`` tokens has at most ``depth - m`` after it (a 15-token match in a 16-deep trie: one token,
# so an answer met before was drafted one token a step). Half leaves 8 tokens of continuation to a match of 8.
MATCH_SHARE = 0.5
MAX_DRAFT = 16  # nodes a draft may add to the root
MIN_SHARE = 0.02  # a branch whose path frequency falls below this is not expanded
CACHE_TOKENS = 16_384  # the shared cache's default size, in output tokens (about 64 long answers)
MIN_MATCH = (1, 2)  # the shortest match drafted from, in this request's trie and in the shared cache (whose
# 1-token matches fan out to hundreds of continuations and seldom pay)
BUCKET_LOWS = (1, 2, 3, 4, 8)  # match lengths calibrated apart: 1, 2, 3, 4-7, 8+ tokens
BUCKETS = ("1", "2", "3", "4-7", "8+")
PRIOR = (2.0, 3.0)  # a bucket's calibration before evidence: 2 of 3 expected tokens accepted
FORGET = 0.998  # per step a match does not draft, its bucket's evidence fades by this much towards the prior
# (half of it in about 350 steps: a short match whose drafts missed is retried about once in 60 of the steps it
# matches on a CPU's cost curve; at 0.99, once in 13, and those tries cost MT-bench about 1% of its time)


class _Node:
    """A view of one trie node, its count and children, for callers that walk the trie (the trie keeps plain ints)."""

    __slots__ = ("_trie", "id")

    def __init__(self, trie: SuffixTrie, node: int):
        self._trie, self.id = trie, node

    @property
    def count(self) -> int:
        return self._trie.counts[self.id]

    @property
    def kids(self) -> dict[int, _Node]:
        return {tok: _Node(self._trie, kid) for tok, kid in self._trie.children[self.id].items()}


class SuffixTrie:
    """Every substring of at most ``depth`` tokens of the sequences added, with its count of occurrences.

    Node ``i``'s children are ``children[i]`` (token -> node) and its count ``counts[i]``; node 0 is the root, and
    freed nodes' ids are reused. Only ints, in lists and in dicts of ints, which Python's garbage collector does not
    track: as objects, a full cache's 1.5 * 10^5 nodes made each full pass of the collector take ~75 ms instead of
    ~8 (Xeon family 6 model 207), and the cache's growth set passes off while ``auto`` decoded, whatever drafted."""

    def __init__(self, depth: int = DEPTH):
        if depth < 2:
            raise ValueError("a suffix trie needs a depth of at least 2")
        self.depth = depth
        self.children: list[dict[int, int]] = [{}]
        self.counts: list[int] = [0]
        self._free: list[int] = []  # ids of freed nodes (their children emptied, their counts 0)
        self.nodes = 0  # nodes below the root (what memory grows with)
        self._open: list[int] = []  # extend(): the nodes of the substrings ending at the last token, longest first

    @property
    def root(self) -> _Node:
        return _Node(self, 0)

    def extend(self, token: int) -> None:
        """Append ``token`` to the sequence being grown: count each substring that now ends with it."""
        children, counts, free = self.children, self.counts, self._free
        still = []
        for node in [*self._open, 0]:
            kids = children[node]
            kid = kids.get(token)
            if kid is None:  # a new node: a freed one's id, or the next
                if free:
                    kid = free.pop()
                else:
                    kid = len(counts)
                    children.append({})
                    counts.append(0)
                kids[token] = kid
                self.nodes += 1
            counts[kid] += 1
            still.append(kid)
        if len(still) == self.depth:  # the longest has ``depth`` tokens: nothing longer is counted
            del still[0]
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
        children, counts = self.children, self.counts
        toks = [int(t) for t in tokens]
        for start in range(len(toks)):
            node = 0
            for tok in toks[start : start + self.depth]:
                kid = children[node][tok]
                counts[kid] -= 1
                if counts[kid] == 0:  # nothing below it was counted more often: free the whole branch
                    del children[node][tok]
                    self._release(kid)
                    break
                node = kid

    def _release(self, node: int) -> None:
        stack = [node]
        while stack:
            cur = stack.pop()
            stack.extend(self.children[cur].values())
            self.children[cur].clear()
            self.counts[cur] = 0
            self._free.append(cur)
            self.nodes -= 1

    def find(self, context: Sequence[int], shortest: int = 1) -> tuple[int, _Node | None]:
        """The longest suffix of ``context`` (at most ``depth - 1`` tokens, at least ``shortest``) that occurred
        and was followed by something: (its length, its node); (0, None) if none was (:meth:`find_id`)."""
        m, node = self.find_id(context, shortest)
        return (m, _Node(self, node)) if node >= 0 else (0, None)

    def find_id(self, context: Sequence[int], shortest: int = 1) -> tuple[int, int]:
        """:meth:`find` with the node's id; (0, -1) if none. A substring's suffixes occurred whenever it did, so
        the longest is found by bisection, and where the ``shortest``-token suffix never occurred (most steps,
        with a match of 2 tokens or more asked for) one walk of that many tokens says so."""
        shortest, hi = max(shortest, 1), min(len(context), self.depth - 1)
        if hi < shortest or self._walk(context[len(context) - shortest :]) < 0:
            return 0, -1
        lo = shortest
        while lo < hi:  # the longest m whose suffix occurred
            mid = (lo + hi + 1) // 2
            if self._walk(context[len(context) - mid :]) < 0:
                hi = mid - 1
            else:
                lo = mid
        for m in range(lo, shortest - 1, -1):  # the longest of those that something followed
            node = self._walk(context[len(context) - m :])
            if node >= 0 and self.children[node]:
                return m, node
        return 0, -1

    def _walk(self, tokens: Sequence[int]) -> int:
        """The node of ``tokens``, or -1 where they never occurred."""
        children, node = self.children, 0
        for tok in tokens:
            node = children[node].get(int(tok), -1)
            if node < 0:
                return -1
        return node


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
                 chains: bool = False, cost_curve: Mapping[int, float] = CPU_COST_CURVE, local: bool = True,
                 calibration: dict[tuple[int, int], list[float]] | None = None):
        self.cache = cache if cache is not None else SuffixCache(depth=depth)
        self.depth, self.max_draft, self.chains = depth, max_draft, chains
        self.max_match = max(1, int(depth * MATCH_SHARE))  # the rest of the trie's depth is the continuation's
        self.local = local  # False: the shared cache alone (``auto``, whose prompt lookup covers the context)
        self.namespace = ""  # the cache's namespace for the next generations (an API key, or "" for all)
        # per (trie, match-length bucket): tokens accepted, tokens the frequencies expected (prior 2/3); a batch's
        # sequences pass one dict, so that what one's drafts earned prices the others' (as one drafter's, across
        # the requests of ``generate``)
        self._calib = calibration if calibration is not None else self.calibration()
        self._drafted: tuple[int, int] | None = None  # the (trie, bucket) the last draft came from
        self._last: tuple[DraftTree, list[float]] | None = None  # its last tree, and its nodes' shares (root's not)
        self.use_cost_curve(cost_curve)
        self.reset()

    def recall(self) -> Drafter | None:
        """Itself, unless it drafts from the shared cache alone and that cache is off (nothing to recall)."""
        return self if self.local or self.cache.max_tokens else None

    @staticmethod
    def calibration() -> dict[tuple[int, int], list[float]]:
        """A calibration at its prior, per (trie, match-length bucket)."""
        return {(t, b): [*PRIOR] for t in range(2) for b in range(len(BUCKETS))}

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

    def _expand(self, trie: SuffixTrie, node: int, budget: int, priced=None) -> tuple[list[int], list[int], list[float]]:
        """The matched node's continuations best first: node tokens, parents (-1: the root), path shares. Shares
        never grow along the expansion (a node's is at most its parent's), so the first one bounds them all:
        ``priced(first share)`` is asked before the expansion, which stops there (returns nothing) where it says so."""
        children, counts = trie.children, trie.counts
        toks: list[int] = []
        parents: list[int] = []
        shares: list[float] = []
        heap: list[tuple[float, int, int, int, int]] = []  # (-share, order, parent, token, node)
        order = 0

        def push(parent: int, nd: int, share: float) -> None:
            nonlocal order
            kids = children[nd]
            total = sum(counts[k] for k in kids.values())
            items = kids.items()
            if self.chains and kids:  # a chain: only the most frequent continuation
                items = [max(items, key=lambda kv: counts[kv[1]])]
            unseen = 1 if parent < 0 else 0  # at the match, one unseen continuation: one occurrence is weak evidence
            for tok, kid in items:
                p = share * counts[kid] / (total + unseen)
                if p >= MIN_SHARE:
                    heapq.heappush(heap, (-p, order, parent, tok, kid))
                    order += 1

        push(-1, node, 1.0)
        if priced is not None and heap and priced(-heap[0][0]):
            return toks, parents, shares
        while heap and len(toks) < budget:
            neg, _, parent, tok, kid = heapq.heappop(heap)
            toks.append(tok)
            parents.append(parent)
            shares.append(-neg)
            push(len(toks) - 1, kid, -neg)
        return toks, parents, shares

    def _best(self, trie: SuffixTrie, node: int, budget: int, key: tuple[int, int], bar: float | None = None
              ) -> tuple[float, list[int], list[int], list[float], bool]:
        """The prefix of the best-first expansion with the most expected tokens per unit of step cost: (its value,
        tokens, parents, shares, whether it drafts). Priced before it is expanded: where no prefix can beat a plain
        step, nothing is expanded (the same answer: it drafts nothing); where no prefix can beat ``bar`` (another
        source's proposal) though the first node beats a plain step, it drafts, at a value <= ``bar``, with no tokens."""
        acc, exp = self._calib[key]
        # A node's chance: its share times what the bucket's drafts earned against their shares, at most 1. The
        # unseen continuation counted at a match halves a path seen once, and a bucket whose drafts all land (an
        # answer met before) earns about twice its shares.
        rate = acc / exp
        plain, cost = 1.0 / self._cost[0], self._cost
        first: list[float] = []

        def priced(top: float) -> bool:  # every prefix of N nodes is worth at most (1 + N min(1, rate top)) / cost[N]
            sure = min(1.0, rate * top)
            most = max((1.0 + n * sure) / cost[n] for n in range(1, budget + 1)) * (1 + 1e-9)  # (rounding)
            if most <= plain:
                return True
            value = (1.0 + sure) / cost[1]
            if bar is not None and most <= bar and value > plain:
                first.append(value)
                return True
            return False

        toks, parents, shares = self._expand(trie, node, budget, priced)
        if first:  # it drafts, but cannot beat ``bar``: no tree is made
            return first[0], [], [], [], True
        best_n, best_v, expected = 0, plain, 1.0
        for n, s in enumerate(shares, start=1):
            expected += min(1.0, rate * s)
            value = expected / cost[n]
            if value > best_v:
                best_n, best_v = n, value
        return best_v, toks[:best_n], parents[:best_n], shares[:best_n], best_n > 0

    def propose(self, ctx: DraftContext) -> DraftTree:
        value, tree = self.draft(ctx)
        return tree if tree is not None else DraftTree.root(int(ctx.tokens[-1])).priced(value)

    def draft(self, ctx: DraftContext, bar: float | None = None) -> tuple[float, DraftTree | None]:
        """What :meth:`propose` proposes, as (its value, its tree), the tree None where it drafts nothing (a plain
        step, at a plain step's value). A caller that weighs it against another source's proposal worth ``bar``
        (``auto``, every step; the suffix wins few) may get no tree where it could not take it: where one trie
        matched and the match's price (what any draft from it can be worth, from its best continuation's share)
        cannot beat ``bar``, nothing is expanded, and the value is at most ``bar``. Where it beats ``bar`` the
        proposal is the same as without, and what the drafter learns is the same either way."""
        tokens = np.asarray(ctx.tokens, dtype=np.int64)
        root = int(tokens[-1])
        seen = self._follow(tokens) if self.local else tokens[-self.depth : -1].tolist()
        budget = min(ctx.max_nodes - 1, self.max_draft)
        self._expected, plain = 0.0, 1.0 / self._cost[0]
        self._last = None
        if budget < 1:
            return plain, None
        context = [*seen[-(self.max_match - 1) :], root] if self.max_match > 1 else [root]
        best, used, matched = (plain, [], [], [], False), None, []
        with self.cache.lock:
            found = []
            for t, trie in enumerate((self._local if self.local else None, self.cache.trie(self.namespace))):
                if trie is not None:
                    m, node = trie.find_id(context, MIN_MATCH[t])  # a shorter match is not drafted from
                    if node >= 0:
                        found.append((trie, node, (t, _bucket(m))))
            for trie, node, key in found:
                matched.append(key)
                # with two matches, which of them drafts decides whose evidence fades: both are priced in full
                cand = self._best(trie, node, budget, key, bar if len(found) == 1 else None)
                if cand[0] > best[0]:
                    best, used = cand, key
        value, toks, parents, shares, drafts = best
        self._drafted = used if drafts else None
        for key in matched:  # evidence that kept a match from drafting fades, so it is tried again later
            if key != self._drafted:
                acc, exp = self._calib[key]
                self._calib[key] = [PRIOR[0] + (acc - PRIOR[0]) * FORGET, PRIOR[1] + (exp - PRIOR[1]) * FORGET]
        if not toks:
            return value, None
        self._expected = float(sum(shares))
        rate = self._calib[used][0] / self._calib[used][1]
        chances = np.concatenate([[1.0], np.minimum(1.0, rate * np.asarray(shares))])  # the root's 1.0
        tree = DraftTree(np.array([root, *toks], dtype=np.int64), np.array([-1, *(p + 1 for p in parents)]),
                         value=value, chances=chances)
        self._last = (tree, shares)
        return value, tree

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        if self._drafted is not None:  # what the frequencies promised against what verification kept
            calib = self._calib[self._drafted]
            calib[0] += len(nodes) - 1
            calib[1] += self._expected
        self._last = None

    def observed(self, emitted: Sequence[int]) -> None:
        """A cut draft's main path against the tokens the step emitted, as far as they reach: a batch that cuts
        every draft to a row or two would else never learn that a long one (an answer met before) lands. A path's
        share is the chance that it lands whole, so over the first ``seen`` tokens its agreement is expected to be
        the sum of their shares."""
        if self._drafted is None or self._last is None:
            return
        tree, shares = self._last
        self._last = None
        path = tree.main_nodes()[1:]  # its drafted nodes along the main path
        seen = min(len(emitted), len(path))
        agree = next((i for i in range(seen) if tree.tokens[path[i]] != emitted[i]), seen)
        calib = self._calib[self._drafted]
        calib[0] += agree
        calib[1] += sum(shares[j - 1] for j in path[:seen])

    def profile(self) -> dict:
        rates = {f"{'local' if t == 0 else 'cache'}:{BUCKETS[b]}": round(a / e, 3)
                 for (t, b), (a, e) in self._calib.items()}
        return {"suffix_cache_tokens": self.cache.tokens, "suffix_cache_nodes": self.cache.nodes,
                "suffix_calibration": rates}


def _bucket(match: int) -> int:
    """The calibration bucket of a match of ``match`` tokens (:data:`BUCKETS`)."""
    return next(i for i, low in reversed(list(enumerate(BUCKET_LOWS))) if match >= low)
