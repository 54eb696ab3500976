"""Checks that tests in more than one folder make on an engine (tiny bundles and the real ones alike)."""

from __future__ import annotations

import threading

import numpy as np
from specdeploy.runtime import load
from specdeploy.runtime.decode import DecodeStats, GenerationConfig
from specdeploy.runtime.drafters.auto import FreeSources
from specdeploy.runtime.drafters.base import DraftContext, Drafter
from specdeploy.runtime.drafters.prompt_lookup import PromptLookupDrafter
from specdeploy.runtime.drafters.suffix import SuffixCache, SuffixDrafter
from specdeploy.runtime.tree import DraftTree

# Batch tests' prompts: repetitive ones give prompt lookup something to find; the varied lengths make rows of other
# lengths.
BATCH_PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat",
                 "one two three four one two three four one two three",
                 "Story: once upon a time in Paris",
                 "a b c d e f g a b c d e f g a b c d",
                 "Write a poem about rivers.",
                 "x y z x y z x y z x y z x y z x y z x y z x y z",
                 "Hello",
                 "red green blue red green blue red"]


def draft_context(tokens: list[int], max_nodes: int = 17) -> DraftContext:
    """A drafter's context over ``tokens``, with placeholder base states (for drafters that read tokens only)."""
    return DraftContext(np.asarray(tokens, dtype=np.int64), np.zeros((1, 4), np.float32), None, max_nodes)


def free_sources(curve) -> FreeSources:
    """``auto``'s free sources, prompt lookup and the suffix drafter (an empty cache), on the cost curve ``curve``."""
    return FreeSources(PromptLookupDrafter(cost_curve=curve), SuffixDrafter(SuffixCache(), cost_curve=curve))


def concurrently(eng, prompts, messages_list=None, **kw):
    """``eng.generate`` of each prompt (or message list) in a thread of its own, all at once; the results in order."""
    out: dict[int, object] = {}

    def go(i: int) -> None:
        if messages_list is not None:
            out[i] = eng.generate(messages=messages_list[i], **kw)
        else:
            out[i] = eng.generate(prompts[i], **kw)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return [out[i] for i in range(len(prompts))]


def check_plan(plain, spec, validate_text: str) -> None:
    """Both engines run the plan the probe chose, and validate reported the same choice."""
    assert plain.plan.candidate == spec.plan.candidate and plain.plan.exact == spec.plan.exact
    said = f"step plan '{spec.plan.candidate.name}'" if spec.plan.exact else "plain decoding only"
    assert f"runtime: {spec.plan.reason.split(':')[0]}" in validate_text and said in validate_text
    assert (spec.decoder.drafter is not None) == spec.plan.speculate
    assert spec.decoder.chains_only == (not spec.plan.trees) and spec.decoder.min_rows == spec.plan.min_rows


def suffix_identity(bundle, prompts: list[str], tokens: int) -> list[DecodeStats]:
    """The suffix drafter on ``prompts`` and their first two again, each output identical to plain decoding."""
    with load(bundle, draft=None) as plain, load(bundle, draft="suffix") as spec:
        assert spec.draft_name == "suffix" or not spec.plan.speculate
        out = []
        for text in prompts + prompts[:2]:  # the repeats find the first answers in the shared cache
            ids = plain.encode(text, chat=True)
            stats = DecodeStats()
            assert spec.generate_ids(ids, GenerationConfig(tokens), stats) == plain.generate_ids(
                ids, GenerationConfig(tokens))
            out.append(stats)
        if spec.plan.speculate:
            assert spec.decoder.drafter.cache.tokens > 0  # the outputs went into the shared cache
        return out


class OracleDrafter(Drafter):
    """Random trees in which one random root path carries the true continuation for a random length.

    Accepted paths therefore run through arbitrary (non-first) branches, which exercises the KV
    commit: a wrong row move changes every later token.
    """

    kind = "oracle"

    def __init__(self, prompt_len: int, reference: list[int], max_nodes: int = 12, seed: int = 0, vocab: int = 49152):
        self.prompt_len, self.reference = prompt_len, reference
        self.max_nodes, self.rng, self.vocab = max_nodes, np.random.default_rng(seed), vocab

    def propose(self, ctx: DraftContext) -> DraftTree:
        n = int(self.rng.integers(1, min(self.max_nodes, ctx.max_nodes) + 1))
        parents = np.array([-1] + [int(self.rng.integers(0, i)) for i in range(1, n)], dtype=np.int64)
        tokens = self.rng.integers(0, self.vocab, n).astype(np.int64)
        tokens[0] = ctx.tokens[-1]
        # Pick a random leaf-ward path and write the truth along it, for a random prefix of it.
        done = len(ctx.tokens) - self.prompt_len  # tokens of the reference already emitted
        leaf = int(self.rng.integers(0, n))
        path = []
        while leaf > 0:
            path.append(leaf)
            leaf = int(parents[leaf])
        path.reverse()
        good = int(self.rng.integers(0, len(path) + 1))
        for depth, node in enumerate(path[:good]):
            if done + depth < len(self.reference):
                tokens[node] = self.reference[done + depth]
        return DraftTree(tokens=tokens, parents=parents)


def pairs_fit(draw, expected: dict[tuple[int, int], float], n: int = 5000) -> float:
    """The chi-square p-value of ``draw(n)``'s token pairs against ``expected`` (pair -> probability), and of a
    second, independent ``draw(n)`` where the first falls at or under 0.05: a correct sampler falls there one
    draw in twenty, two draws in a row one in four hundred, while a sampler off by what 5,000 draws can see
    falls there each time. A pair outside ``expected`` fails at once."""
    from scipy.stats import chisquare

    cells = sorted(expected)
    want = np.array([expected[c] for c in cells])
    p = 0.0
    for _ in range(2):
        pairs = draw(n)
        assert len(pairs) == n and set(pairs) <= set(expected), set(pairs) - set(expected)
        observed = np.array([pairs.count(c) for c in cells], dtype=float)
        p = chisquare(observed, want / want.sum() * n).pvalue
        if p > 0.05:
            break
    return p
