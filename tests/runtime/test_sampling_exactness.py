"""Sampling acceptance (runtime/verify.py): logit warping, tree rejection sampling against the warped base
distribution with chi-square tests (plus wrong rules the same tests must reject, to show they have power),
and typical acceptance, the labelled lossy rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import chisquare
from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.tree import DraftTree
from specdeploy.runtime.verify import greedy_accept, sample_accept, sample_from, typical_accept, warp_logits
from tree_strategies import FAST, assert_valid_path, draft_cases, longest_ok_path

# ---------------------------------------------------------------------------------------------------
# warping


def naive_warp(logits, temperature, top_k, top_p):
    z = logits.astype(np.float64) / temperature
    if top_k:
        z[z < np.sort(z)[-top_k]] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    mass = np.cumsum(p[order])
    keep_n = int(np.searchsorted(mass, top_p)) + 1
    p[p < p[order[min(keep_n, p.size) - 1]]] = 0.0
    return p / p.sum()


@pytest.mark.parametrize("v", [6, 1000])
def test_warp_logits_matches_full_sort(v):
    rng = np.random.default_rng(v)
    for _ in range(50):
        logits = rng.normal(scale=rng.choice([0.1, 1.0, 4.0]), size=v).astype(np.float32)
        t, k, p = (
            rng.choice([0.5, 1.0, 1.5]),
            int(rng.choice([0, 3, v // 2])),
            rng.choice([0.3, 0.9, 0.99, 1.0]),
        )
        got = warp_logits(logits, t, k, p)
        np.testing.assert_allclose(got, naive_warp(logits, t, k, p), rtol=1e-12, atol=1e-15)
        assert got.sum() == pytest.approx(1.0)
    batch = rng.normal(size=(3, v))
    np.testing.assert_allclose(warp_logits(batch, 0.7, 0, 0.9)[1], warp_logits(batch[1], 0.7, 0, 0.9))
    assert warp_logits(np.array([1.0, 5.0, 5.0]), 0.0).tolist() == [0.0, 1.0, 0.0]
    for bad in ((-1.0, 0, 1.0), (1.0, -1, 1.0), (1.0, 0, 0.0), (1.0, 0, 1.5)):
        with pytest.raises(SpecDeployError):
            warp_logits(logits, *bad)


def test_sample_from_never_draws_zero_mass():
    rng = np.random.default_rng(0)
    p = np.array([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])
    assert {sample_from(p, rng) for _ in range(2000)} == {1, 4}
    # several 256-wide blocks, a partial last block, unnormalised input
    p = np.zeros(1000)
    p[[0, 255, 256, 300, 511, 700, 998, 999]] = [3.0, 1.0, 0.5, 2.0, 1.0, 0.25, 1.0, 4.0]
    draws = np.array([sample_from(p, rng) for _ in range(N_SAMPLES)])
    assert chi2_pvalue(draws, p / p.sum()) > 1e-3


# ---------------------------------------------------------------------------------------------------
# sampling exactness (chi-square against the warped base distribution)

V = 6
N_SAMPLES = 20000
ROOT_LOGITS = np.log(np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05]))


def chi2_pvalue(samples, probs):
    """p-value of samples ~ probs; tokens with zero probability must never appear."""
    counts = np.bincount(samples, minlength=probs.size)
    assert counts[probs == 0].sum() == 0, "drew a token the base distribution forbids"
    pos = probs > 0
    return chisquare(counts[pos], probs[pos] * counts.sum()).pvalue


def tree_with_children(child_tokens, seed=0):
    """Root plus one level of sibling drafts; each child gets its own random logits."""
    n = 1 + len(child_tokens)
    tree = DraftTree([0, *child_tokens], [-1] + [0] * (n - 1))
    logits = np.random.default_rng(seed).normal(size=(n, V))
    logits[0] = ROOT_LOGITS
    return tree, logits


WARPS = [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8}]


@pytest.mark.parametrize(
    "child_tokens,warp",
    [([0, 1], WARPS[0]), ([5, 4, 3], WARPS[1]), ([2, 2, 0], WARPS[2]), ([1, 5], WARPS[2])],
    ids=["likely", "unlikely-topk", "duplicate-topp", "cut-by-topp"],
)
def test_sample_accept_first_token_is_exact(child_tokens, warp):
    tree, logits = tree_with_children(child_tokens)
    buffers, rng = tree.buffers(), np.random.default_rng(1)
    first = [sample_accept(tree, buffers, logits, rng, **warp).tokens[0] for _ in range(N_SAMPLES)]
    assert chi2_pvalue(np.array(first), warp_logits(ROOT_LOGITS, **warp)) > 1e-3


def test_sample_accept_second_token_conditional_is_exact():
    # root -> a(0), b(1); a -> c(2), d(3); b -> e(0). A first token 0 or 1 can only come from
    # accepting a or b (rejecting a zeroes token 0), so the second token follows that node's logits.
    tree = DraftTree([0, 0, 1, 2, 3, 0], [-1, 0, 0, 1, 1, 2])
    logits = np.random.default_rng(3).normal(size=(6, V))
    logits[0] = ROOT_LOGITS
    buffers, rng = tree.buffers(), np.random.default_rng(2)
    out = [sample_accept(tree, buffers, logits, rng, temperature=0.9).tokens[:2] for _ in range(N_SAMPLES)]
    first = np.array([o[0] for o in out])
    assert chi2_pvalue(first, warp_logits(ROOT_LOGITS, 0.9)) > 1e-3
    for token, node in ((0, 1), (1, 2)):
        second = np.array([o[1] for o in out if o[0] == token])
        assert chi2_pvalue(second, warp_logits(logits[node], 0.9)) > 1e-3


def test_sample_accept_with_draft_probs_is_exact():
    # Siblings drawn independently from their own proposals q1, q2 (unlike p), every trial afresh.
    p = warp_logits(ROOT_LOGITS)
    q = np.array([[0.05, 0.05, 0.1, 0.2, 0.3, 0.3], [0.3, 0.1, 0.1, 0.1, 0.1, 0.3]])
    draft_probs = np.vstack([np.full(V, 1.0 / V), q])  # [N, V]; row 0 unused
    rng = np.random.default_rng(4)
    first = []
    for _ in range(N_SAMPLES):
        drafts = [sample_from(q[0], rng), sample_from(q[1], rng)]
        tree = DraftTree([0, *drafts], [-1, 0, 0])
        logits = np.vstack([ROOT_LOGITS, np.zeros((2, V))])
        first.append(sample_accept(tree, tree.buffers(), logits, rng, draft_probs=draft_probs).tokens[0])
    assert chi2_pvalue(np.array(first), p) > 1e-3


def _wrong_always_accept_first(tree, logits, rng):
    return tree.tokens[1]


def _wrong_forget_residual(tree, logits, rng):
    """Accept x with p(x), but on rejection sample from the unchanged p (biased towards x)."""
    p = warp_logits(logits[0])
    x = tree.tokens[1]
    return x if rng.random() < p[x] else sample_from(p, rng)


@pytest.mark.parametrize("rule", [_wrong_always_accept_first, _wrong_forget_residual])
def test_chi_square_rejects_wrong_rules(rule):
    tree, logits = tree_with_children([0])
    rng = np.random.default_rng(5)
    first = np.array([rule(tree, logits, rng) for _ in range(N_SAMPLES)])
    try:
        pvalue = chi2_pvalue(first, warp_logits(ROOT_LOGITS))
    except AssertionError:  # a forbidden token is also a failure of the rule
        return
    assert pvalue < 1e-6


# ---------------------------------------------------------------------------------------------------
# typical acceptance (lossy)


def typical_ok(tree, logits, temperature, threshold=0.09, alpha=0.3):
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    h = -(p * np.log(p)).sum(-1)
    thr = np.minimum(threshold, alpha * np.exp(-h))
    return [True] + [
        p[tree.parents[i], tree.tokens[i]] > thr[tree.parents[i]] for i in range(1, tree.num_nodes)
    ]


@FAST
@given(
    draft_cases(vocab=5, unique_siblings=False), st.sampled_from([0.5, 1.0, 2.0]), st.integers(0, 2**32 - 1)
)
def test_typical_accept_accepts_only_typical_tokens(case, temperature, seed):
    tree, logits = case
    logits = logits * 1.5  # sharper rows so some tokens fall under the threshold
    acc = typical_accept(tree, tree.buffers(), logits, temperature, rng=np.random.default_rng(seed))
    assert_valid_path(tree, acc)
    assert len(acc.tokens) >= 1
    ok = typical_ok(tree, logits, temperature)
    assert all(ok[i] for i in acc.nodes)
    assert len(acc.nodes) == longest_ok_path(tree.parents, ok)


def test_typical_accept_temperature_zero_is_greedy():
    tree, logits = tree_with_children([0, 1, 2])
    acc = typical_accept(tree, tree.buffers(), logits, 0.0)
    ref = greedy_accept(tree, tree.buffers(), logits)
    assert acc.tokens.tolist() == ref.tokens.tolist()



def test_top_k_over_a_grammars_masked_rows_keeps_what_the_whole_row_gives():
    """``warp_logits`` takes the k-th largest of a masked row's finite values (fast where a grammar leaves few): the
    kept set, ties included, is the one the k-th largest of the whole row gives."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        z = np.round(rng.standard_normal((int(rng.integers(1, 4)), 50)), 1).astype(np.float32)  # ties at the cut
        z[rng.random(z.shape) < rng.random()] = -np.inf
        z[:, 0] = 0.5  # every row keeps a finite value
        k = int(rng.integers(1, 50))
        whole = z.astype(np.float64)
        whole[whole < np.partition(whole, 50 - k, axis=-1)[:, 50 - k, None]] = -np.inf
        assert np.array_equal(warp_logits(z, 1.3, k) > 0, np.isfinite(whole))
