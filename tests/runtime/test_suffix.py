"""The suffix drafter (``runtime/drafters/suffix.py``): its count trie against a brute-force reference, the
shared cache's bound and isolation, and greedy identity with plain decoding, on the tiny and the real model."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import numpy as np
import pytest
from decode_checks import suffix_identity
from hypothesis import given, settings
from hypothesis import strategies as st
from specdeploy.runtime import load
from specdeploy.runtime.drafters.base import DraftContext
from specdeploy.runtime.drafters.suffix import SuffixCache, SuffixDrafter, SuffixTrie

seqs = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=30), min_size=1, max_size=5)


def _brute(sequences: list[list[int]], context: list[int], depth: int) -> tuple[int, Counter]:
    """The longest suffix of ``context`` (< depth tokens) that some sequence continues, and what follows it."""
    for m in range(min(len(context), depth - 1), 0, -1):
        pat = context[len(context) - m :]
        nxt = Counter(s[i + m] for s in sequences for i in range(len(s) - m) if s[i : i + m] == pat)
        if nxt:
            return m, nxt
    return 0, Counter()


def _dump(node, prefix=()) -> dict:
    out = {}
    for tok, kid in node.kids.items():
        out[(*prefix, tok)] = kid.count
        out.update(_dump(kid, (*prefix, tok)))
    return out


@settings(max_examples=200, deadline=None)
@given(seqs, st.lists(st.integers(0, 4), min_size=1, max_size=8), st.integers(2, 6), st.integers(1, 3))
def test_the_trie_finds_what_brute_force_finds(sequences, context, depth, shortest):
    trie = SuffixTrie(depth)
    for s in sequences:
        trie.add(s)
    m, node = trie.find(context, shortest)
    want_m, want = _brute(sequences, context, depth)
    want_m = want_m if want_m >= shortest else 0  # a shorter match is not asked for
    assert m == want_m and (node is None) == (m == 0)
    if m:
        # counts of the continuations within the depth: a substring of m + 1 tokens, m + 1 <= depth
        assert {tok: kid.count for tok, kid in node.kids.items()} == dict(want)
    assert trie.nodes == len(_dump(trie.root))


@settings(max_examples=200, deadline=None)
@given(seqs, seqs, st.integers(2, 6))
def test_removing_a_sequence_leaves_the_trie_of_the_others(keep, drop, depth):
    trie, ref = SuffixTrie(depth), SuffixTrie(depth)
    for s in keep + drop:
        trie.add(s)
    for s in keep:
        ref.add(s)
    for s in drop:
        trie.remove(s)
    assert _dump(trie.root) == _dump(ref.root) and trie.nodes == ref.nodes


def test_find_walks_once_where_the_shortest_suffix_asked_for_never_occurred(monkeypatch):
    """Most steps of ``auto`` match nothing of 2 tokens or more in the shared cache: one walk of 2 tokens says so."""
    trie = SuffixTrie(16)
    trie.add([1, 2, 3, 4, 5, 6, 7, 8])
    walks = []
    walk = SuffixTrie._walk
    monkeypatch.setattr(SuffixTrie, "_walk", lambda self, toks: walks.append(list(toks)) or walk(self, toks))
    assert trie.find([9, 8, 7, 6, 5], shortest=2) == (0, None) and walks == [[6, 5]]
    walks.clear()
    m, node = trie.find([9, 1, 2, 3], shortest=2)
    assert m == 3 and {t: k.count for t, k in node.kids.items()} == {4: 1} and len(walks) > 1


def test_a_cache_of_many_outputs_adds_nothing_the_garbage_collector_tracks():
    """The trie is ints in lists and dicts of ints: a full cache adds nothing to the collector's full passes (as
    objects, a full cache's 1.5 * 10^5 nodes made each pass ~75 ms instead of ~8, and set passes off while ``auto``
    decoded)."""
    import gc

    rng = np.random.default_rng(2)
    cache = SuffixCache(max_tokens=4_000)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(60):
        cache.add(rng.integers(0, 300, size=100).tolist())
    gc.collect()
    assert cache.nodes > 20_000 and len(gc.get_objects()) - before < 100


def test_growing_token_by_token_equals_adding_the_whole_sequence():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, size=200).tolist()
    grown, whole = SuffixTrie(5), SuffixTrie(5)
    for tok in seq:
        grown.extend(tok)
    whole.add(seq)
    assert _dump(grown.root) == _dump(whole.root)


def test_the_cache_holds_memory_flat_over_10000_requests():
    rng = np.random.default_rng(1)
    cache = SuffixCache(max_tokens=2_000, depth=8)
    peak = []
    for i in range(10_000):
        cache.add(rng.integers(0, 50, size=int(rng.integers(2, 120))).tolist(), namespace=f"key{i % 7}")
        assert cache.tokens <= 2_000
        if i % 1000 == 999:
            peak.append(cache.nodes)
    assert max(peak) <= 2_000 * 8  # at most depth nodes per cached token
    assert max(peak) < 1.2 * min(peak)  # flat: the last thousand requests hold what the first did
    while cache._order:  # evicting everything frees every node: nothing leaks
        cache.add(list(range(1, 2_001)), namespace="flush")
        cache.add([0, 0], namespace="other")
        if all(ns in ("flush", "other") for ns, _ in cache._order):
            break
    assert set(cache._tries) <= {"flush", "other"} and cache.tokens <= 2_000


def test_namespaces_keep_requests_apart_and_zero_turns_the_cache_off():
    cache = SuffixCache(max_tokens=100)
    cache.add([1, 2, 3, 4, 5], namespace="alice")
    assert cache.trie("alice").find([9, 2, 3])[0] == 2 and cache.trie("bob") is None
    off = SuffixCache(max_tokens=0)
    off.add([1, 2, 3])
    assert off.tokens == 0 and off.trie() is None
    with pytest.raises(ValueError, match="0 \\(off\\) or more"):
        SuffixCache(max_tokens=-1)
    # what a batch asks in the steps its load gate runs plain: nothing where the cache is off and it reads only it
    assert SuffixDrafter(off, local=False).recall() is None
    assert SuffixDrafter(off).recall() is not None and SuffixDrafter(cache, local=False).recall() is not None


def _ctx(tokens: list[int], budget: int = 17) -> DraftContext:
    return DraftContext(np.asarray(tokens, dtype=np.int64), np.zeros((1, 4), np.float32), None, budget)


def test_the_drafter_drafts_from_the_cache_and_its_own_context():
    drafter = SuffixDrafter(SuffixCache(), chains=False, cost_curve={1: 1.0, 16: 1.05})
    template = [7, 8, 9, 10, 11, 12, 13, 14]
    drafter.finished([100, 101, *template], prompt_len=2)  # an earlier request's output
    tree = drafter.propose(_ctx([50, 51, 7, 8]))
    assert tree.tokens[0] == 8 and tree.tokens[1:].tolist() == template[2:]  # its continuation, as a chain
    drafter.reset()
    tree = drafter.propose(_ctx([1, 2, 3, 1, 2, 4, 9, 1, 2]))  # its own context: 1 2 -> 3 and 1 2 -> 4
    assert tree.tokens[0] == 2 and sorted(tree.tokens[tree.parents == 0].tolist()) == [3, 4]  # two branches
    chains = SuffixDrafter(SuffixCache(), chains=True, cost_curve={1: 1.0, 16: 1.05})
    tree = chains.propose(_ctx([1, 2, 3, 1, 2, 4, 9, 1, 2]))
    assert (tree.parents == np.arange(-1, len(tree.tokens) - 1)).all()  # chains only: one branch
    dear = SuffixDrafter(SuffixCache(), cost_curve={1: 1.0, 2: 3.0, 16: 30.0})  # drafting never pays
    assert dear.propose(_ctx([1, 2, 3, 1, 2, 4, 9, 1, 2])).num_nodes == 1


def test_an_answer_met_before_is_drafted_half_the_tries_depth_ahead_deep_into_it():
    """Deep into an answer the cache holds, the match is cut to half the trie's depth so that the other half is
    left to draft: the longest match a 16-deep trie holds (15 tokens) has one token after it."""
    answer = list(range(100, 160))
    drafter = SuffixDrafter(SuffixCache(), chains=True, cost_curve={1: 1.0, 16: 1.05}, local=False)
    drafter.finished([1, 2, *answer], prompt_len=2)
    for at in (3, 20, 40):  # tokens of the answer already decoded
        tree = drafter.propose(_ctx([1, 2, *answer[:at]], budget=17))
        assert tree.tokens[1:].tolist() == answer[at : at + drafter.depth - min(at, drafter.max_match)]
        assert tree.num_nodes - 1 >= drafter.depth // 2
    ctx = _ctx([1, 2, *answer[:30]])
    for _ in range(10):  # every draft lands: the bucket earns twice the shares of a path seen once (0.5 each)
        tree = drafter.propose(ctx)
        drafter.accepted(np.arange(tree.num_nodes), tree)
    value, tree = drafter.draft(ctx)  # so it is priced near-certain, not at half its tokens
    assert value * 1.05 >= 0.95 * tree.num_nodes


def test_a_cut_draft_learns_from_the_tokens_its_step_emitted():
    """A batch that cuts a draft to its root verifies none of it; the tokens its step emitted still judge the first
    ones, so a long draft that lands is learned as near-certain, and one that misses as unlikely."""
    answer = list(range(100, 160))
    for emitted, lands in ((answer[30:31], True), ([7], False)):
        drafter = SuffixDrafter(SuffixCache(), chains=True, cost_curve={1: 1.0, 16: 1.05}, local=False)
        drafter.finished([1, 2, *answer], prompt_len=2)
        ctx = _ctx([1, 2, *answer[:30]])
        for _ in range(20):
            drafter.propose(ctx)
            drafter.observed(emitted)
        value, tree = drafter.draft(ctx)
        assert (value * 1.05 >= 0.8 * tree.num_nodes) if lands else (value * 1.05 < 0.3 * tree.num_nodes), value
        drafter.accepted(np.arange(2), tree)
        rates = drafter.profile()["suffix_calibration"]
        drafter.observed(answer[30:31])  # judged already: nothing more is learned
        assert drafter.profile()["suffix_calibration"] == rates


def test_a_match_whose_drafts_missed_is_tried_again_seldom():
    """A 2-token match that the cache saw continued one way three times drafts deep at first; once its drafts miss,
    its evidence fades back towards the prior on the steps it matches without drafting, so it is tried again, but
    seldom (on a CPU's cost curve a retry is a step of several rows that earns nothing)."""
    drafter = SuffixDrafter(SuffixCache(), cost_curve={1: 1.0, 2: 1.17, 4: 1.53, 8: 2.28, 16: 3.96}, local=False)
    for _ in range(3):
        drafter.cache.add(list(range(1, 17)))
    ctx = _ctx([50, 1, 2])
    tries = []
    for step in range(1000):
        _, tree = drafter.draft(ctx)
        if tree is not None:
            tries.append(step)
            drafter.accepted(np.array([0]), tree)  # it misses: the root alone
    assert tries[0] == 0 and len(tries) > 2  # tried, and tried again
    assert all(b - a >= 50 for a, b in pairwise(tries)), tries  # once it has missed, seldom


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=2, max_size=40), min_size=1, max_size=6),
       st.lists(st.lists(st.integers(0, 5), min_size=2, max_size=12), min_size=1, max_size=12),
       st.floats(0.5, 4.0), st.integers(2, 17), st.booleans(), st.booleans(),
       st.sampled_from([{1: 1.0, 16: 1.05}, {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.6, 16: 4.4}]))
def test_a_draft_priced_against_a_bar_learns_the_same_and_makes_no_tree_it_would_not_take(
        outputs, contexts, bar, budget, local, chains, curve):
    """``draft(ctx, bar)`` (what ``auto`` asks, ``bar`` being lookup's proposal) against ``draft(ctx)``: the same
    proposal where it beats ``bar``; else a value of at most ``bar`` (no tree, or the same); and the same
    calibration after."""
    cache = SuffixCache()
    for out in outputs:
        cache.add(out)
    full = SuffixDrafter(cache, chains=chains, cost_curve=curve, local=local)
    priced = SuffixDrafter(cache, chains=chains, cost_curve=curve, local=local)
    for ctx in contexts:
        want_value, want = full.draft(_ctx(ctx, budget))
        value, tree = priced.draft(_ctx(ctx, budget), bar)
        if want_value > bar:
            assert value == want_value and (tree is None) == (want is None)
            if tree is not None:
                assert tree.tokens.tolist() == want.tokens.tolist() and tree.parents.tolist() == want.parents.tolist()
                nodes = np.arange(min(2, tree.num_nodes))  # its first drafted token accepted
                full.accepted(nodes, want)
                priced.accepted(nodes, tree)
        else:
            assert value <= bar and (tree is None or tree.tokens.tolist() == want.tokens.tolist())
        assert priced._calib == full._calib and priced._drafted == full._drafted


def test_a_match_that_cannot_beat_the_bar_is_not_expanded(monkeypatch):
    """A long continuation seen once: a draft of it is worth at most ~1.3 here, less than lookup's 2.5, so ``auto``'s
    suffix stops at its price (it still drafts there, so its bucket's evidence does not fade)."""
    expanded = []
    expand = SuffixDrafter._expand

    def spy(self, *args):
        out = expand(self, *args)
        expanded.append(out[0])
        return out

    monkeypatch.setattr(SuffixDrafter, "_expand", spy)
    curve = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.6, 16: 4.4}
    drafter = SuffixDrafter(SuffixCache(), cost_curve=curve, local=False)
    drafter.finished([0, 0, *range(10, 30)], prompt_len=2)
    value, tree = drafter.draft(_ctx([5, 10, 11]), 2.5)
    assert tree is None and 1.0 < value <= 2.5 and expanded == [[]] and drafter._drafted == (1, 1)
    value, tree = drafter.draft(_ctx([5, 10, 11]))  # asked for its proposal: expanded, the same value's tree
    assert tree.tokens[1:4].tolist() == [12, 13, 14] and len(expanded[-1]) == 14 and tree.value < 2.5


PROMPTS = ["Fill in the form: name Ann, age 31, city Oslo. Reply as JSON with keys name, age, city.",
           "Fill in the form: name Bob, age 42, city Rome. Reply as JSON with keys name, age, city.",
           "one two three four one two three four one two"]


def test_suffix_drafts_equal_plain_decoding_on_the_tiny_model(tiny_bundle):
    suffix_identity(tiny_bundle, PROMPTS, 32)


def test_the_engine_shares_one_cache_and_keeps_namespaces_apart(tiny_bundle):
    from specdeploy.runtime.errors import DraftMismatchError

    with load(tiny_bundle, draft="suffix", suffix_cache_tokens=500) as engine:
        if not engine.plan.speculate:
            pytest.skip(f"no exact plan on this machine: {engine.plan.reason}")
        cache = engine.decoder.drafter.cache
        assert cache.max_tokens == 500
        engine.generate(PROMPTS[0], max_new_tokens=12, cache_namespace="alice")
        engine.generate(PROMPTS[1], max_new_tokens=12)
        assert set(cache._tries) == {"alice", ""} and cache.tokens == 2 * 12  # the two outputs
        stream = engine.stream(PROMPTS[2], max_new_tokens=12, cache_namespace="bob")
        for i, _ in enumerate(stream):
            if i == 4:
                break
        stream.close()  # stopped early: what it had generated is still learned
        assert stream.completion.finish_reason == "cancelled"
        assert "bob" in cache._tries
    with pytest.raises(DraftMismatchError, match="0 \\(off\\) or more tokens; got -1"):
        load(tiny_bundle, draft="suffix", suffix_cache_tokens=-1)
