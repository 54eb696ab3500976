"""``auto``'s free sources (``runtime/drafters/auto.py``, :class:`FreeSources`): which proposal each step takes,
prompt lookup's or the suffix drafter's, and what pricing the suffix against lookup's proposal leaves unchanged."""

from __future__ import annotations

import numpy as np
from decode_checks import draft_context as _ctx
from decode_checks import free_sources as _free
from specdeploy.runtime.drafters import make_drafter
from specdeploy.runtime.drafters.auto import FreeSources
from specdeploy.runtime.drafters.prompt_lookup import PromptLookupDrafter
from specdeploy.runtime.drafters.suffix import SuffixCache, SuffixDrafter

FLAT = {1: 1.0, 16: 1.05}  # a GPU-like cost curve: drafting is nearly free


def test_free_sources_take_the_proposal_worth_more():
    free = _free(FLAT)
    free.suffix.finished([0, 0, 40, 41, 42, 43, 44, 45, 46, 47], prompt_len=2)  # an earlier answer
    tree = free.propose(_ctx([9, 8, 40, 41]))  # only the suffix cache has seen "40 41"
    assert tree.tokens[1:4].tolist() == [42, 43, 44] and free.sources["suffix"] == 1
    free.accepted(np.array([0, 1, 2]), tree)  # told to the suffix drafter, which drafted it
    assert free.suffix._calib[(1, 1)][0] == 2 + 2  # the cache's trie, a 2-token match
    tree = free.propose(_ctx([5, 6, 7, 1, 5, 6]))  # lookup and suffix both see "5 6 -> 7"
    assert tree.num_nodes > 1 and free.sources["lookup"] + free.sources["suffix"] == 2
    dear = _free({1: 1.0, 2: 5.0, 16: 50.0})  # nothing pays on this curve: a plain step
    assert dear.propose(_ctx([5, 6, 7, 1, 5, 6])).num_nodes == 1 and dear.sources["plain"] == 1


def test_a_trie_of_matches_is_priced_as_its_main_path():
    """Lookup's trie of two matches is worth what its first match alone is (the chain its length rule chose), so a
    source that drafts worse cannot win its steps on the trie's extra rows."""
    curve = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.6, 16: 4.4}
    trie, chain = PromptLookupDrafter(cost_curve=curve), PromptLookupDrafter(cost_curve=curve, branches=1)
    ctx = _ctx([5, 6, 7, 9, 1, 5, 6, 8, 2, 5, 6])  # 5 6 -> 8 2 ..., and 7 9 ...
    got, alone = trie.propose(ctx), chain.propose(ctx)
    assert got.num_nodes > got.main_path().num_nodes == alone.num_nodes > 1
    assert got.main_path().tokens.tolist() == alone.tokens.tolist() and got.value == alone.value > 1.0


def test_free_sources_draft_whatever_lookup_alone_would():
    """Where the suffix drafter has nothing, ``auto``'s free sources propose what prompt lookup alone proposes, step
    for step, tries of two matches included (a suffix price with no tree behind it once turned such steps plain)."""
    curve = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.6, 16: 4.4}
    free = FreeSources(PromptLookupDrafter(cost_curve=curve), SuffixDrafter(SuffixCache(), cost_curve=curve, local=False))
    alone = PromptLookupDrafter(cost_curve=curve)
    rng = np.random.default_rng(7)
    text = np.tile(rng.integers(0, 9, size=25), 16)
    text[rng.random(len(text)) < 0.15] = 9  # repeats, with some breaks in them
    tries = 0
    for end in range(6, len(text)):
        got, want = free.propose(_ctx(text[:end].tolist())), alone.propose(_ctx(text[:end].tolist()))
        assert (got.tokens.tolist(), got.parents.tolist()) == (want.tokens.tolist(), want.parents.tolist())
        tries += want.num_nodes > want.main_path().num_nodes
        main = want.main_path().tokens[1:]  # nodes 1..L of the trie: its first match
        wrong = np.nonzero(main != text[end : end + len(main)])[0]
        nodes = np.arange(1 + (wrong[0] if len(wrong) else len(main)))
        free.accepted(nodes, got)
        alone.accepted(nodes, want)
    assert tries > 0 and free.sources["suffix"] == 0


def test_the_suffix_reads_the_requests_own_context_and_drafts_a_copy_where_lookup_branches_wrong(tiny_bundle):
    """``auto``'s suffix drafter reads this request's context, not only the shared cache: where the text copies a
    stretch of its context, its 8-token match knows the continuation that lookup's 3-gram mixes up with another
    (a second turn rewriting the first answer). Its recall in a batch's plain steps stays the shared cache's."""
    from specdeploy.runtime.bundle import read_manifest

    curve = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.6, 16: 4.4}
    copied = list(range(100, 130))
    other = [*copied[10:13], 300, 301, 302, 303, 304]  # the same 3-gram, another continuation, later
    ctx = _ctx([*copied, *other, *copied[:13]])  # now copying ``copied`` again: 100 ... 112 -> 113 114 ...
    lookup_alone = PromptLookupDrafter(cost_curve=curve).propose(ctx)
    assert lookup_alone.main_path().tokens[1:3].tolist() == [300, 301]  # the most recent match first: wrong
    for local, first in ((True, [113, 114, 115]), (False, [300, 301])):
        free = FreeSources(PromptLookupDrafter(cost_curve=curve), SuffixDrafter(SuffixCache(), cost_curve=curve,
                                                                                local=local))
        free.suffix._calib[(0, 4)] = [20.0, 10.0]  # its 8+ token matches have landed: twice what one sighting says
        tree = free.propose(ctx)
        assert tree.main_path().tokens[1 : 1 + len(first)].tolist() == first
        assert free.source == ("suffix" if local else "lookup")
        if local:
            assert tree.num_nodes == tree.main_path().num_nodes  # one chain: no second branch's rows
    manifest = read_manifest(tiny_bundle)
    for tokens, recalls in ((0, False), (100, True)):
        drafter = make_drafter("auto", tiny_bundle, manifest, suffix_cache_tokens=tokens)
        assert drafter.suffix.local and (drafter.recall() is drafter.suffix) == recalls


def test_pricing_the_suffix_before_proposing_changes_no_choice():
    """``auto`` asks the suffix drafter for a tree only where it may beat lookup's proposal: the proposals, the
    sources counted and what both sources learn are those of asking it in full every step."""
    curve = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.6, 16: 4.4}
    rng = np.random.default_rng(3)
    earlier = [rng.integers(0, 12, size=60).tolist() for _ in range(4)]
    priced, full = _free(curve), _free(curve)
    draft = full.suffix.draft
    full.suffix.draft = lambda ctx, bar=None: draft(ctx)  # no bar: every match expanded, every tree made
    for free in (priced, full):
        for out in earlier:
            free.finished([0, *out], prompt_len=1)
    text = rng.integers(0, 12, size=400).tolist()
    for end in range(8, len(text)):
        got, want = priced.propose(_ctx(text[:end])), full.propose(_ctx(text[:end]))
        assert (got.tokens.tolist(), got.parents.tolist(), got.value) == (want.tokens.tolist(), want.parents.tolist(),
                                                                          want.value)
        nodes = np.arange(min(2, got.num_nodes))
        priced.accepted(nodes, got)
        full.accepted(nodes, want)
    assert priced.sources == full.sources and priced.sources["suffix"] > 0 and priced.sources["lookup"] > 0
    assert priced.suffix._calib == full.suffix._calib
