"""The decode loop on a tiny random model: speculative greedy == plain greedy, KV commit, edge cases,
and exactness of speculative sampling through the whole loop."""

from __future__ import annotations

import numpy as np
import pytest
from decode_checks import OracleDrafter
from scipy.stats import chisquare
from specdeploy.runtime import load
from specdeploy.runtime.decode import Decoder, DecodeStats, GenerationConfig, SamplingParams
from specdeploy.runtime.drafters.base import DraftContext, Drafter
from specdeploy.runtime.errors import PromptError, TreeSpecError
from specdeploy.runtime.plan import Candidate, StepPlan
from specdeploy.runtime.tree import DraftTree
from specdeploy.runtime.verify import warp_logits


def _chain(root_token: int, tokens) -> DraftTree:
    """A single chain of draft tokens after ``root_token``."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    return DraftTree(np.concatenate([[root_token], tokens]), np.arange(-1, tokens.size, dtype=np.int64))


def _plain(engine, ids, n):
    return engine.generate_ids(ids, GenerationConfig(n))


def test_speculative_greedy_matches_plain_with_random_trees(tiny_bundle):
    with load(tiny_bundle, draft=None) as engine:
        for seed, text in enumerate(["Hello there, how are you today?", "1 2 3 4 5", "a"]):
            ids = engine.encode(text)
            ref = _plain(engine, ids, 40)
            drafter = OracleDrafter(len(ids), ref, seed=seed)
            dec = Decoder(engine.backend, engine.manifest, drafter, plan=engine.plan)
            stats = DecodeStats()
            out = list(dec.generate(ids, GenerationConfig(40), stats))
            assert out == ref
            assert stats.mean_accepted > 1.2  # the oracle's paths were really accepted
            assert len(stats.accepted) == stats.steps


def test_prompt_lookup_matches_plain_on_repetitive_text(tiny_bundle):
    text = "one two three four one two three four one two three four one two"
    with load(tiny_bundle, draft=None) as plain, load(tiny_bundle, draft="prompt-lookup") as spec:
        ids = plain.encode(text)
        for tree in (None, "chain4"):
            eng = spec if tree is None else load(tiny_bundle, draft="prompt-lookup", tree=tree)
            assert eng.generate_ids(ids, GenerationConfig(48)) == _plain(plain, ids, 48)


def _scan_continuations(tokens: list[int], drafter, n_max: int = 3, n_min: int = 1, branches: int = 2):
    """Prompt lookup by a full scan of the context (what the drafter's n-gram index must reproduce)."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        length = drafter._length(n)
        if length == 0:
            continue
        out: list[list[int]] = []
        for start in range(len(tokens) - 1 - n, -1, -1):  # every n-gram but the suffix, latest first
            cont = tokens[start + n : start + n + length]
            if tokens[start : start + n] == tokens[-n:] and cont and cont not in out:
                out.append(cont)
                if len(out) == branches:
                    break
        if out:
            return n, out
    return 0, []


def test_prompt_lookup_index_matches_a_full_scan():
    """The incremental n-gram index finds the continuations a scan of the whole context finds, as the
    context grows by accepted runs, with the stats (and so the lengths) changing, and after a switch to
    a context that does not extend the last one."""
    from specdeploy.runtime.drafters import PromptLookupDrafter

    rng = np.random.default_rng(0)
    drafter = PromptLookupDrafter()
    tokens = [int(t) for t in rng.integers(0, 12, 40)]
    matched = 0
    for step in range(300):
        if step == 150:  # another context (same length class, not an extension): the index starts over
            tokens = [int(t) for t in rng.integers(0, 12, 30)]
        got = drafter._continuations(np.array(tokens, dtype=np.int64))
        assert got == _scan_continuations(tokens, drafter), step
        matched += got[0] > 0
        tree = drafter.propose(DraftContext(np.array(tokens, dtype=np.int64), None, None, 32))
        run = int(rng.integers(1, 5))
        drafter.accepted(np.arange(min(run, len(tree.tokens))), tree)
        tokens += [int(t) for t in rng.integers(0, 12, run)]
    assert matched > 250


def test_prompt_lookup_drafts_only_what_pays_on_the_cost_curve():
    """Lookup acceptance is bimodal: matches are wrong at once or right for a while. The drafter keeps
    the first token's rate apart from the later tokens' and drafts the length that pays on the
    backend's cost curve, nothing at all when no length does."""
    from specdeploy.runtime.drafters import PromptLookupDrafter

    steep = {1: 1.0, 2: 1.13, 4: 1.5, 8: 2.5, 16: 4.0, 32: 7.0}  # int4 with row-exact 1-row steps
    flat = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3, 32: 2.0}  # a memory-bound fp32 graph

    def learnt(curve, outcomes):
        d = PromptLookupDrafter(cost_curve=curve)
        for k in outcomes:  # k drafted tokens accepted of 10
            d._last = (3, 10)
            d.accepted(np.arange(k + 1), None)
        return d._length(3)

    fresh = PromptLookupDrafter(cost_curve=steep)._length(3)
    assert fresh >= 1  # the optimistic prior tries new matches
    assert learnt(steep, [0] * 20) == 0  # always wrong: plain steps (on the flat curve drafting is ~free)
    bimodal = [0, 0, 0, 0, 8] * 8  # right 1 in 5 times, then for 8 tokens
    assert learnt(steep, bimodal) <= 1 < learnt(flat, bimodal)
    assert learnt(steep, [10] * 20) == learnt(flat, [10] * 20) == 10  # always right: the longest draft


def test_lookup_expected_tokens_are_the_beta_chain_formula():
    """The plain-Python expected tokens (one call per drafted step) equal 1 + p1 (1 + a + ... + a^(L-1)),
    and the array form agrees with the scalar one."""
    from specdeploy.runtime.drafters.prompt_lookup import ChainAcceptance

    acc = ChainAcceptance()
    for accepted, drafted in [(0, 3), (2, 3), (5, 10), (0, 1), (3, 3)]:
        acc.update(accepted, drafted)
    p1, a = acc.first[0] / sum(acc.first), acc.later[0] / sum(acc.later)
    want = [1.0 + p1 * sum(a**j for j in range(length)) for length in range(11)]
    assert acc.expected_up_to(10) == pytest.approx(want, rel=1e-12)
    assert acc.expected_tokens(np.array([0, 3, 10])) == pytest.approx([want[0], want[3], want[10]], rel=1e-12)


def test_eos_inside_accepted_path_stops_there(tiny_bundle):
    with load(tiny_bundle, draft=None) as engine:
        ids = engine.encode("The end is near")
        ref = _plain(engine, ids, 30)
        eos_at = 7
        manifest = engine.manifest.replace(
            model=engine.manifest.model.__class__(**{**engine.manifest.model.__dict__, "eos_token_ids": (ref[eos_at],)})
        )
        plain = list(Decoder(engine.backend, manifest, plan=engine.plan).generate(ids, GenerationConfig(30)))
        assert plain == ref[: ref.index(ref[eos_at]) + 1]
        dec = Decoder(engine.backend, manifest, OracleDrafter(len(ids), ref, max_nodes=16, seed=3), plan=engine.plan)
        stats = DecodeStats()
        assert list(dec.generate(ids, GenerationConfig(30), stats)) == plain
        assert stats.finish_reason == "stop"


def test_max_tokens_reached_mid_path(tiny_bundle):
    with load(tiny_bundle, draft=None) as engine:
        ids = engine.encode("Counting: 1, 2, 3")
        ref = _plain(engine, ids, 40)

        class Chain(Drafter):
            def propose(self, ctx):  # the next true tokens: every step accepts all + a bonus
                done = len(ctx.tokens) - len(ids)
                return _chain(ctx.tokens[-1], ref[done : done + min(8, ctx.max_nodes - 1)])

        for n in (1, 2, 5, 11, 13):
            stats = DecodeStats()
            out = list(Decoder(engine.backend, engine.manifest, Chain(), plan=engine.plan).generate(ids, GenerationConfig(n), stats))
            assert out == ref[:n] and stats.new_tokens == n and stats.finish_reason == "length"


def test_cache_bucket_boundary(tiny_bundle):
    """Generation that crosses the 256-slot bucket reallocates the cache without changing tokens."""
    with load(tiny_bundle, draft=None) as engine:
        ids = engine.encode("word " * 120)[:240]
        ref = _plain(engine, ids, 40)
        drafter = OracleDrafter(len(ids), ref, max_nodes=16, seed=5)
        dec = Decoder(engine.backend, engine.manifest, drafter, plan=engine.plan)
        assert list(dec.generate(ids, GenerationConfig(40))) == ref


def test_one_token_prompt_and_context_limit(tiny_bundle):
    with load(tiny_bundle, draft=None) as engine:
        assert len(_plain(engine, [5], 8)) == 8
        limit = engine.manifest.limits.max_context
        stats = DecodeStats()
        out = list(engine.decoder.generate([5] * (limit - 4), GenerationConfig(50), stats))
        assert len(out) <= 4 and stats.finish_reason in ("length", "stop")
        with pytest.raises(PromptError, match="maximum context"):
            _plain(engine, [5] * limit, 4)
        with pytest.raises(PromptError, match="empty"):
            engine.generate("", max_new_tokens=4)


@pytest.mark.parametrize("min_rows", [1, 2])
def test_speculative_stops_at_the_context_limit_like_plain(tiny_bundle, min_rows):
    """A draft that is always right must not carry the output past the context limit (it once did, by
    one token: a step's last emitted token needs no slot yet but counts towards the context)."""

    class Truth(Drafter):
        kind = "truth"

        def propose(self, ctx):
            done = len(ctx.tokens) - len(ids)
            return _chain(ctx.tokens[-1], ref[done : done + ctx.max_nodes - 1])

    with load(tiny_bundle, draft=None) as engine:
        plan = StepPlan(Candidate("forced", False, min_rows), True, True, False, 16, "forced")
        limit = engine.manifest.limits.max_context
        ids = [5, 6, 7, 8] * ((limit - 10) // 4)
        stats = DecodeStats()
        ref = list(Decoder(engine.backend, engine.manifest, None, plan=plan).generate(ids, GenerationConfig(40), stats))
        assert len(ids) + len(ref) <= limit
        dec = Decoder(engine.backend, engine.manifest, Truth(), plan=plan)
        spec_stats = DecodeStats()
        assert list(dec.generate(ids, GenerationConfig(40), spec_stats)) == ref
        assert spec_stats.finish_reason == stats.finish_reason
        if stats.finish_reason == "length":
            assert len(ids) + len(ref) == limit and max(spec_stats.accepted) > 1


def test_drafter_that_breaks_the_contract_is_refused(tiny_bundle):
    class TooBig(Drafter):
        def propose(self, ctx):
            return _chain(ctx.tokens[-1], [1] * (ctx.max_nodes + 3))

    with load(tiny_bundle, draft=None) as engine:
        dec = Decoder(engine.backend, engine.manifest, TooBig(), plan=engine.plan)
        with pytest.raises(TreeSpecError):
            list(dec.generate(engine.encode("hi there"), GenerationConfig(8)))


def test_invalid_tree_argument_is_one_sentence(tiny_bundle):
    with pytest.raises(TreeSpecError):
        load(tiny_bundle, draft="prompt-lookup", tree="[[0,0]]")  # dangling: (0,) missing
    with pytest.raises(TreeSpecError):
        load(tiny_bundle, draft="prompt-lookup", tree="no-such-tree")


@pytest.mark.parametrize("drafted", ["likely", "unlikely"])
def test_speculative_sampling_is_exact_through_the_loop(tiny_bundle, drafted):
    """First sampled token via the full loop (prefill + tree step) vs the base softmax: chi-square."""
    with load(tiny_bundle, draft=None) as engine:
        ids = engine.encode("Once upon a time")
        sampling = SamplingParams(temperature=1.5, top_k=8)
        dec0 = Decoder(engine.backend, engine.manifest, plan=engine.plan)
        state, out = dec0.prefill(ids)
        first = int(np.argmax(out.logits[0, -1]))
        # The distribution of the 2nd emitted token given the 1st is `first`: one step from the root.
        root_tree = _chain(first, [])
        logits = dec0.verify(state, root_tree, root_tree.buffers()).logits[0, 0]
        p = warp_logits(logits, 1.5, 8, 1.0)
        support = np.flatnonzero(p)
        order = support[np.argsort(-p[support])]
        drafts = order[:3] if drafted == "likely" else order[-3:]

        class Fixed(Drafter):
            def propose(self, ctx):  # three sibling drafts under the root
                return DraftTree(np.array([ctx.tokens[-1], *drafts]), np.array([-1, 0, 0, 0]))

        counts = np.zeros(len(p))
        rng = np.random.default_rng(0)
        dec = Decoder(engine.backend, engine.manifest, Fixed(), plan=engine.plan)
        n = 3000
        for _ in range(n):
            st, _ = dec.prefill(ids)
            st.tokens.append(first)
            tree = dec.propose(st, 4)
            bufs = tree.buffers()
            o = dec.verify(st, tree, bufs)
            acc = dec.accept(tree, bufs, o, sampling, rng, len(st.tokens))
            counts[acc.tokens[0]] += 1
        expected = p[support] * n
        stat = chisquare(counts[support], expected)
        assert counts[np.setdiff1d(np.arange(len(p)), support)].sum() == 0
        assert stat.pvalue > 1e-3, (stat, counts[support], expected)


def test_a_tree_commit_moves_only_its_own_rows_keys():
    # Decoder.step commits each sequence's accepted nodes in its own cache row: a branch's nodes move to the
    # columns after the root, the other rows stay as they were, and an accepted chain prefix moves nothing.
    from specdeploy.runtime.kvcache import KVCache

    cache = KVCache.allocate_for(2, 1, 4, 3, 16, lambda shape: np.zeros(shape, dtype=np.float32))
    for i, buf in enumerate(cache.buffers()):
        buf[...] = np.arange(buf.size, dtype=np.float32).reshape(buf.shape) + 1000 * i
    before = [buf.copy() for buf in cache.buffers()]
    cache.commit_row(1, 5, np.array([0, 2, 3]))  # the root at column 5, then nodes 2 and 3 of its tree
    for old, buf in zip(before, cache.buffers()):
        np.testing.assert_array_equal(buf[1, :, 5:8], old[1, :, [5, 7, 8]].transpose(1, 0, 2))
        np.testing.assert_array_equal(np.delete(buf, 1, axis=0), np.delete(old, 1, axis=0))
        np.testing.assert_array_equal(buf[1, :, :5], old[1, :, :5])
        np.testing.assert_array_equal(buf[1, :, 8:], old[1, :, 8:])
    now = [buf.copy() for buf in cache.buffers()]
    cache.commit_row(0, 2, np.array([0, 1, 2]))
    assert all(np.array_equal(a, b) for a, b in zip(now, cache.buffers()))


def test_a_large_cache_buffer_is_zeroed_in_ordinary_pages_of_its_own():
    """numpy would ask for huge pages for a buffer of 4 MiB or more, whose first writes may wait for the kernel to
    compact memory: such a buffer is an anonymous mapping instead, zeroed and writable as numpy's."""
    import mmap

    from specdeploy.runtime.kvcache import SMALL_PAGES_FROM, zeroed

    big = zeroed((4, 3, 2048, 64), np.float32)
    assert big.nbytes >= SMALL_PAGES_FROM and isinstance(big.base.base.obj, mmap.mmap)
    assert big.shape == (4, 3, 2048, 64) and big.dtype == np.float32 and big.flags.c_contiguous
    assert not big.any()
    big[3, 2, 2047] = 1.0
    assert big.sum() == 64.0
    small = zeroed((1, 3, 64, 64), np.float32)
    assert small.base is None and not small.any()
