"""Trees as data (runtime/tree.py) and acceptance rules (runtime/verify.py).

Greedy acceptance is checked against plain greedy decoding through an oracle model whose logits
are the tree's, and sampling acceptance against the warped base distribution with chi-square tests
(plus wrong rules that the same tests must reject, to show they have power).
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from specdeploy.runtime.errors import SpecDeployError, TreeSpecError
from specdeploy.runtime.tree import (
    STATIC_TREES,
    DraftTree,
    TreeSpec,
    build_buffers,
    parse_tree_arg,
    select_dynamic,
)
from specdeploy.runtime.tree_cost import CPU_COST_CURVE, choose_default_tree, expected_tokens
from specdeploy.runtime.verify import (
    greedy_accept,
    sample_accept,
    sample_from,
    typical_accept,
    warp_logits,
)

FAST = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------------------------------------------
# strategies and naive references


@st.composite
def parent_arrays(draw, max_nodes=20, max_children=None):
    """parents[0] = -1, parents[i] < i; optionally at most ``max_children`` children per node."""
    n = draw(st.integers(1, max_nodes))
    parents, counts = [-1], [0]
    for i in range(1, n):
        open_nodes = [j for j in range(i) if max_children is None or counts[j] < max_children]
        p = draw(st.sampled_from(open_nodes))
        parents.append(p)
        counts[p] += 1
        counts.append(0)
    return np.array(parents, dtype=np.int64)


@st.composite
def draft_cases(draw, vocab=4, unique_siblings=False, max_nodes=20):
    """(DraftTree, logits [T >= N, V]) with small integer logits, so argmax ties and matches are common."""
    parents = draw(parent_arrays(max_nodes, max_children=vocab if unique_siblings else None))
    n = parents.size
    tokens = np.empty(n, dtype=np.int64)
    tokens[0] = draw(st.integers(0, vocab - 1))
    if unique_siblings:
        perms = {p: draw(st.permutations(range(vocab))) for p in set(parents[1:].tolist())}
        seen: dict[int, int] = {}
        for i in range(1, n):
            k = seen.get(int(parents[i]), 0)
            tokens[i] = perms[int(parents[i])][k]
            seen[int(parents[i])] = k + 1
    else:
        for i in range(1, n):
            tokens[i] = draw(st.integers(0, vocab - 1))
    pad = draw(st.integers(0, 3))  # verification must ignore padded rows
    seed = draw(st.integers(0, 2**32 - 1))
    logits = np.random.default_rng(seed).integers(0, 3, size=(n + pad, vocab)).astype(np.float32)
    return DraftTree(tokens, parents), logits


def children_of(parents):
    return {i: [c for c in range(len(parents)) if parents[c] == i] for i in range(len(parents))}


def ancestors_or_self(parents, i):
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(int(parents[out[-1]]))
    return out[::-1]  # root first


def plain_greedy(tree, logits):
    """Plain greedy decoding where the model's logits after node i are logits[i]; stop on leaving the tree."""
    kids = children_of(tree.parents)
    node, nodes, out = 0, [0], []
    while True:
        t = int(np.argmax(logits[node]))
        out.append(t)
        match = [c for c in kids[node] if tree.tokens[c] == t]
        if not match:
            return nodes, out
        node = match[0]
        nodes.append(node)


def longest_ok_path(parents, ok):
    """Length (in nodes, with root) of the longest root path whose non-root nodes are all ok."""
    kids = children_of(parents)

    def depth(i):
        return 1 + max((depth(c) for c in kids[i] if ok[c]), default=0)

    return depth(0)


def assert_valid_path(tree, acc):
    nodes = acc.nodes.tolist()
    assert nodes[0] == 0 and len(acc.tokens) == len(nodes)
    for a, b in itertools.pairwise(nodes):
        assert tree.parents[b] == a
    assert acc.tokens[:-1].tolist() == tree.tokens[nodes[1:]].tolist()


# ---------------------------------------------------------------------------------------------------
# buffers


@FAST
@given(parent_arrays(max_nodes=24))
def test_buffers_match_naive_construction(parents):
    b = build_buffers(parents)
    n = parents.size
    kids = children_of(parents)
    for i in range(n):
        anc = ancestors_or_self(parents, i)
        assert b.mask[i].tolist() == [j in anc for j in range(n)]
        assert b.depth[i] == len(anc) - 1
        assert b.children[i] == tuple(kids[i])
    leaves = [i for i in range(n) if not kids[i]]
    assert b.retrieve.shape == (len(leaves), int(b.depth.max()) + 1)
    rows = [[int(x) for x in r if x >= 0] for r in b.retrieve]
    assert rows == [ancestors_or_self(parents, leaf) for leaf in leaves]
    assert all(np.all(r[len(p) :] == -1) for r, p in zip(b.retrieve, rows))
    assert b.internal.tolist() == [i for i in range(n) if kids[i]]
    assert build_buffers(tuple(parents.tolist())) is b  # cached by structure
    with pytest.raises(ValueError):
        b.mask[0, 0] = False  # shared between steps, so read-only


def test_verify_rejects_mismatched_buffers_or_logits():
    tree = DraftTree(np.array([0, 1, 2]), np.array([-1, 0, 1]))
    other = DraftTree([0, 1, 2], [-1, 0, 0])
    logits = np.zeros((3, 4))
    with pytest.raises(TreeSpecError):
        greedy_accept(tree, other.buffers(), logits)
    with pytest.raises(TreeSpecError):
        greedy_accept(tree, tree.buffers(), logits[:2])


def test_bad_parents_raise():
    for parents in ([], [0], [-1, 1], [-1, 0, 3], [-1, -1]):
        with pytest.raises(TreeSpecError):
            build_buffers(parents)
    with pytest.raises(TreeSpecError):
        DraftTree([1, 2], [-1, 0, 1])


# ---------------------------------------------------------------------------------------------------
# static trees


def test_treespec_validation_errors():
    with pytest.raises(TreeSpecError, match="Dangling"):
        TreeSpec.static([(0,), (0, 1, 0)])
    with pytest.raises(TreeSpecError, match="more than once"):
        TreeSpec.static([(0,), (0,)])
    with pytest.raises(TreeSpecError):
        TreeSpec.static([(0,), ()])
    with pytest.raises(TreeSpecError):
        TreeSpec.static([(-1,)])
    spec = TreeSpec.static([(0,), (1,), (0, 0), (0, 0, 0)])
    assert spec.validate(max_tree=5, max_depth=3) is spec
    with pytest.raises(TreeSpecError, match="deep"):
        spec.validate(max_tree=64, max_depth=2)
    with pytest.raises(TreeSpecError, match="nodes"):
        spec.validate(max_tree=4, max_depth=4)


def test_treespec_order_and_from_static():
    spec = TreeSpec.static([(0, 0), (1,), (0,), (0, 1)])
    assert spec == TreeSpec.static([(0,), (1,), (0, 0), (0, 1)])
    assert spec.choices == ((0,), (1,), (0, 0), (0, 1))
    assert spec.parents.tolist() == [-1, 0, 0, 1, 1]
    assert (spec.num_nodes, spec.depth, spec.topk) == (5, 2, 2)
    topk = np.array([[10, 11, 12], [20, 21, 22]])
    tree = DraftTree.from_static(spec, 7, topk)
    assert tree.tokens.tolist() == [7, 10, 11, 20, 21]
    with pytest.raises(TreeSpecError):
        DraftTree.from_static(spec, 7, topk[:1])


def test_registry_trees():
    sizes = {"chain4": 5, "tree8": 8, "tree16": 16, "tree32": 32, "tree64": 64}
    for name, spec in STATIC_TREES.items():
        assert spec.num_nodes == sizes[name]
        spec.validate(max_tree=64, max_depth=4)
        assert build_buffers(spec.parents).depth.tolist() == [0] + [len(c) for c in spec.choices]
    assert expected_tokens(STATIC_TREES["chain4"]) == pytest.approx(1 + 0.6 + 0.6**2 + 0.6**3 + 0.6**4)
    # bigger trees never expect fewer tokens; the choice follows the cost curve
    exp = [expected_tokens(STATIC_TREES[n]) for n in ("tree8", "tree16", "tree32", "tree64")]
    assert exp == sorted(exp)
    assert choose_default_tree(CPU_COST_CURVE) in STATIC_TREES
    assert choose_default_tree({1: 1.0, 64: 1.0}) == "tree64"
    assert choose_default_tree({1: 1.0, 64: 64.0}) == "chain4"


def test_parse_tree_arg():
    assert parse_tree_arg("tree16") is STATIC_TREES["tree16"]
    assert parse_tree_arg(" [[0],[1],[0,0]] ").choices == ((0,), (1,), (0, 0))
    assert parse_tree_arg("chain2").choices == ((0,), (0, 0))
    assert parse_tree_arg("chain4").choices == STATIC_TREES["chain4"].choices
    for bad in ("tree99", "[[0],[0,0", '[[0],[1,"a"]]', "{}", "[[true]]", "[0, 1]", "[[0,0]]", "chain0", "chain"):
        with pytest.raises(TreeSpecError):
            parse_tree_arg(bad)


# ---------------------------------------------------------------------------------------------------
# dynamic trees


@st.composite
def candidate_forests(draw, monotone=True):
    m = draw(st.integers(0, 30))
    parents = [draw(st.integers(-1, i - 1)) for i in range(m)]
    steps = draw(st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.5]), min_size=m, max_size=m))
    scores: list[float] = []
    for i in range(m):
        base = scores[parents[i]] if parents[i] >= 0 and monotone else 0.0
        scores.append(base - steps[i])  # a child never outscores its parent when monotone
    return np.array(parents), np.array(scores), draw(st.integers(0, 35))


def _check_dynamic(parents, scores, budget):
    m = parents.size
    tokens = np.arange(m) + 100  # token identifies the candidate
    tree = select_dynamic(parents, tokens, scores, budget, root_token=7)
    assert tree.num_nodes == min(budget, m) + 1 and tree.tokens[0] == 7
    picked = tree.tokens[1:] - 100
    assert len(set(picked.tolist())) == picked.size
    for i in range(1, tree.num_nodes):  # parent structure maps back to the candidates'
        orig_parent = parents[picked[i - 1]]
        assert tree.tokens[tree.parents[i]] == (7 if orig_parent < 0 else orig_parent + 100)
    assert np.array_equal(tree.scores[1:], scores[picked])
    return tree


@FAST
@given(candidate_forests(monotone=True))
def test_select_dynamic_keeps_best_closed_set(case):
    parents, scores, budget = case
    tree = _check_dynamic(parents, scores, budget)
    k = tree.num_nodes - 1
    assert sorted(tree.scores[1:]) == sorted(np.sort(scores)[::-1][:k].tolist())


@FAST
@given(candidate_forests(monotone=False))
def test_select_dynamic_closed_even_if_scores_not_monotone(case):
    _check_dynamic(*case)  # DraftTree itself rejects any parent that was not kept earlier


# ---------------------------------------------------------------------------------------------------
# greedy


@FAST
@given(draft_cases(unique_siblings=True))
def test_greedy_accept_equals_plain_greedy(case):
    tree, logits = case
    acc = greedy_accept(tree, tree.buffers(), logits)
    nodes, out = plain_greedy(tree, logits)
    assert acc.nodes.tolist() == nodes
    assert acc.tokens.tolist() == out
    assert acc.num_accepted_drafts == len(nodes) - 1


@FAST
@given(draft_cases(unique_siblings=False))
def test_greedy_accept_with_the_backends_argmax_reads_no_logits(case):
    """A backend that gives each row's argmax (the torch backend, on the device) gets the same acceptance,
    and verification then reads no logits row (the logits here are a stand-in that refuses reads)."""
    tree, logits = case

    class Unreadable:
        ndim, shape = logits.ndim, logits.shape

        def __getitem__(self, index):
            raise AssertionError("a logits row was read")

    ref = greedy_accept(tree, tree.buffers(), logits)
    acc = greedy_accept(tree, tree.buffers(), Unreadable(), row_argmax=logits.argmax(-1))
    assert acc.nodes.tolist() == ref.nodes.tolist() and acc.tokens.tolist() == ref.tokens.tolist()


@FAST
@given(draft_cases(unique_siblings=False))
def test_greedy_accept_longest_valid_path_with_duplicate_siblings(case):
    tree, logits = case
    acc = greedy_accept(tree, tree.buffers(), logits)
    assert_valid_path(tree, acc)
    am = logits.argmax(-1)
    ok = [True] + [tree.tokens[i] == am[tree.parents[i]] for i in range(1, tree.num_nodes)]
    assert all(ok[i] for i in acc.nodes)
    assert acc.tokens[-1] == am[acc.nodes[-1]]
    assert len(acc.nodes) == longest_ok_path(tree.parents, ok)


@FAST
@given(draft_cases(unique_siblings=True), st.integers(0, 2**32 - 1))
def test_sample_accept_at_temperature_zero_is_greedy(case, seed):
    tree, logits = case
    acc = sample_accept(tree, tree.buffers(), logits, np.random.default_rng(seed), temperature=0.0)
    ref = greedy_accept(tree, tree.buffers(), logits)
    assert acc.tokens.tolist() == ref.tokens.tolist() and acc.nodes.tolist() == ref.nodes.tolist()


def test_root_only_and_chain():
    logits = np.array([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    root = DraftTree([2], [-1])
    assert greedy_accept(root, root.buffers(), logits).tokens.tolist() == [1]
    chain = DraftTree(np.array([2, 1, 0]), np.array([-1, 0, 1]))
    acc = greedy_accept(chain, chain.buffers(), logits)
    assert acc.nodes.tolist() == [0, 1, 2] and acc.tokens.tolist() == [1, 0, 2]


@FAST
@given(parent_arrays(max_nodes=24))
def test_main_path_follows_first_children(parents):
    tree = DraftTree(np.arange(100, 100 + parents.size), parents, scores=-np.arange(parents.size, dtype=float))
    path = tree.main_path()
    assert path.is_chain and path.tokens[0] == 100
    kids = children_of(parents)
    node, want = 0, [0]
    while kids[node]:
        node = min(kids[node])
        want.append(node)
    assert path.tokens.tolist() == [100 + i for i in want]
    assert path.scores.tolist() == [-float(i) for i in want]
    if tree.is_chain:
        assert path is tree


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


def test_runtime_modules_import_only_numpy():
    code = (
        "import sys, specdeploy.runtime.tree, specdeploy.runtime.verify;"
        "bad = [m for m in ('torch', 'transformers', 'scipy') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tree_choice_is_the_one_parser_of_tree_arguments():
    """Static names, chains, JSON paths and dynamic budgets, checked against a bundle's limits in one place."""
    from specdeploy.runtime.tree import DYNAMIC_DEFAULT_NODES, tree_choice

    spec, dyn = tree_choice("chain3", max_tree=64, max_depth=4)
    assert dyn is None and spec.depth == 3 and spec.num_nodes == 4
    assert tree_choice("[[0],[1],[0,0]]", 64, 4)[0].num_nodes == 4
    assert tree_choice("dynamic", 64, 4) == (None, DYNAMIC_DEFAULT_NODES)
    assert tree_choice("dynamic:12", 64, 4) == (None, 12)
    for bad in ("dynamic:1", "dynamic:65", "dynamic:x"):
        with pytest.raises(TreeSpecError, match="A dynamic tree needs 2 to 64 nodes"):
            tree_choice(bad, 64, 4)
    with pytest.raises(TreeSpecError, match="static trees only"):
        tree_choice("dynamic:8", 64, 4, dynamic=False)
    with pytest.raises(TreeSpecError, match="Unknown tree"):
        tree_choice("bushy", 64, 4)
    with pytest.raises(TreeSpecError):
        tree_choice("chain8", 64, 4)  # deeper than the drafter's heads


@st.composite
def chain_cases(draw, vocab=3):
    """(chain tree, logits [N + pad, V]) with small integer logits: ties and long accepted prefixes are common."""
    n = draw(st.integers(1, 12))
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    pad = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**32 - 1))
    logits = np.random.default_rng(seed).integers(0, 2, size=(n + pad, vocab)).astype(np.float32)
    return tokens, logits


@FAST
@given(chain_cases())
def test_chain_fast_path_equals_the_general_tree_rule(case):
    """A chain (made by DraftTree.chain or as a general tree) is verified by a plain-Python path; it gives
    the general rule's acceptance and plain greedy's tokens, with and without the backend's argmax."""
    tokens, logits = case
    fast = DraftTree.chain(tokens)
    general = DraftTree(np.array(tokens), np.arange(-1, len(tokens) - 1))
    assert fast.is_chain and fast.main_path() is fast and fast.parents.tolist() == general.parents.tolist()
    assert fast.buffers().chain and general.buffers().chain
    with pytest.raises(TreeSpecError):
        DraftTree.chain([])
    not_chain = dataclasses.replace(general.buffers(), chain=False)  # forces the general tree code
    ref = greedy_accept(general, not_chain, logits)
    nodes, out = plain_greedy(general, logits)
    assert ref.nodes.tolist() == nodes and ref.tokens.tolist() == out
    for tree in (fast, general):
        for row_argmax in (None, logits.argmax(-1)):
            acc = greedy_accept(tree, tree.buffers(), logits, row_argmax=row_argmax)
            assert acc.nodes.tolist() == nodes and acc.tokens.tolist() == out
            assert acc.tokens.dtype == np.int64 and acc.nodes.dtype == np.int64


@FAST
@given(parent_arrays(max_nodes=12))
def test_buffers_know_chains(parents):
    assert build_buffers(parents).chain == (parents.tolist() == list(range(-1, parents.size - 1)))
