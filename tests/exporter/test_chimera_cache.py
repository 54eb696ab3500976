"""The Chimera drafter's own cache: incremental catch-up, capped catch-ups, kept bindings, and the drafters a
batching engine spawns from one loaded graph."""

from __future__ import annotations

import numpy as np
from specdeploy.runtime import load
from specdeploy.runtime.decode import GenerationConfig


def test_drafter_state_matches_a_fresh_catch_up(chimera_bundle):
    """After several steps the incremental draft cache gives the same heads as re-encoding everything."""
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.chimera import make_chimera_drafter

    manifest = read_manifest(chimera_bundle)
    with load(chimera_bundle, draft=None) as plain:
        ids = plain.encode("The quick brown fox jumps over the lazy dog and")
        out = plain.generate_ids(ids, GenerationConfig(12))
        full = ids + out
        # base hidden states of every position, from one prefill over the whole text
        state, _ = plain.decoder.prefill(full[:-1])
        hidden = state.hidden
    inc = make_chimera_drafter(chimera_bundle, manifest, tree="chain4")
    fresh = make_chimera_drafter(chimera_bundle, manifest, tree="chain4")
    n0 = len(ids)
    a = inc.head_topk(np.asarray(full[: n0 + 1]), hidden[:n0])
    for cut in (n0 + 3, n0 + 4, n0 + 8):  # accept 3, 1, then 4 nodes
        a = inc.head_topk(np.asarray(full[: cut + 1]), hidden[inc.length : cut])
    b = fresh.head_topk(np.asarray(full[: n0 + 9]), hidden[: n0 + 8])
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1], atol=1e-4)


def test_slots_left_out_of_a_catch_up_are_never_attended(chimera_bundle):
    """Given only the latest states (a capped catch-up), the drafter leaves the slots before them empty and
    masked: whatever those slots hold, the heads are the same, at the first call and after a second gap."""
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.chimera import make_chimera_drafter

    manifest = read_manifest(chimera_bundle)
    rng = np.random.default_rng(3)
    n = 60
    tokens = rng.integers(0, manifest.model.vocab_size, n + 1)
    hidden = rng.normal(size=(n, manifest.model.hidden_size)).astype(np.float32)
    outs = []
    for garbage in (False, True):
        d = make_chimera_drafter(chimera_bundle, manifest, tree="chain4")
        got = []
        for cut, took in ((30, 6), (n, 5)):  # slots 0..23 and 30..54 are left out
            if garbage:  # junk in every slot not yet written (the gaps among them)
                d._ensure(n + 8)
                d._k[:, :, d.length:] = rng.normal(scale=50.0, size=d._k[:, :, d.length:].shape)
                d._v[:, :, d.length:] = rng.normal(scale=50.0, size=d._v[:, :, d.length:].shape)
            got.append(d.head_topk(tokens[: cut + 1], hidden[cut - took : cut]))
        outs.append(got)
    for clean, junk in zip(*outs):
        np.testing.assert_array_equal(clean[0], junk[0])
        np.testing.assert_array_equal(clean[1], junk[1])


def test_a_batching_engines_drafters_share_the_draft_graph_and_keep_their_own_caches(chimera_bundle):
    """A batching engine makes a drafter per request: after the first, each is spawned from it, sharing its loaded
    draft graph, what it earned and what its calls cost (and the suffix drafts' record), with a draft cache of its own,
    and proposes what a drafter made anew does; an explicit trained draft's drafters share theirs."""
    from specdeploy.runtime.batch import drafter_factory
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.chimera import make_chimera_drafter

    manifest = read_manifest(chimera_bundle)
    make = drafter_factory("auto", chimera_bundle, manifest, chains=True)
    one, two = make(), make()
    first, second = one.model, two.model
    assert first.session is second.session and first._k is None and second._k is None
    # What the draft earned is the engine's, as generate's auto keeps it across requests: a new request does not
    # try, on an optimistic prior, a draft that has stopped paying.
    one.model_acceptance.update(0, 3)
    assert two.model_acceptance is one.model_acceptance and make().model_acceptance.first == one.model_acceptance.first
    # and what its calls cost (a catch-up included): each prices its first call by what another's took
    assert two.timer is one.timer
    paid = drafter_factory("chimera", chimera_bundle, manifest, chains=True)
    a, b = paid(), paid()
    assert b.timer is a.timer and b.model_acceptance is a.model_acceptance and a.timer is not one.timer
    # so is what the suffix drafts earned, with the cache they draft from
    assert one.lookup.suffix._calib is two.lookup.suffix._calib and one.lookup.suffix.cache is two.lookup.suffix.cache
    assert one.lookup.suffix._calib is not drafter_factory("auto", chimera_bundle, manifest)().lookup.suffix._calib
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, manifest.model.vocab_size, 12)
    hidden = rng.normal(size=(11, manifest.model.hidden_size)).astype(np.float32)
    first.head_topk(tokens[:6], hidden[:5])  # another request's state, in the first one's cache
    got = make().model.head_topk(tokens, hidden)
    want = make_chimera_drafter(chimera_bundle, manifest, tree=f"chain{first.depth}").head_topk(tokens, hidden)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_the_kept_binding_drafts_as_a_fresh_one_across_cache_growth(chimera_bundle):
    """The drafter keeps one IOBinding per draft-cache buffer set; stepping past a regrowth of the cache
    (256 -> 512 slots) it proposes exactly what a drafter binding afresh at every call does."""
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.chimera import MIN_CAPACITY, make_chimera_drafter

    manifest = read_manifest(chimera_bundle)
    kept = make_chimera_drafter(chimera_bundle, manifest, tree="chain4")
    fresh = make_chimera_drafter(chimera_bundle, manifest, tree="chain4")
    run = fresh._run

    def rebinding(*args, **kwargs):
        fresh._binding = None
        return run(*args, **kwargs)

    fresh._run = rebinding
    rng = np.random.default_rng(5)
    n = MIN_CAPACITY + 12
    tokens = rng.integers(0, manifest.model.vocab_size, n + 1)
    hidden = rng.normal(size=(n, manifest.model.hidden_size)).astype(np.float32)
    start = MIN_CAPACITY - 10
    for d in (kept, fresh):
        d.head_topk(tokens[: start + 1], hidden[:start])
    grew = False
    for cut in range(start + 1, n):  # one accepted token per step, through the regrowth
        a = kept.head_topk(tokens[: cut + 1], hidden[cut - 1 : cut])
        b = fresh.head_topk(tokens[: cut + 1], hidden[cut - 1 : cut])
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        grew = grew or kept._k.shape[2] > MIN_CAPACITY
    assert grew
