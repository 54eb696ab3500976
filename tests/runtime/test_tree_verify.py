"""Trees as data (runtime/tree.py), dynamic selection, the tree table, and greedy acceptance (runtime/verify.py).

Greedy acceptance is checked against plain greedy decoding through an oracle model whose logits are the
tree's. Sampling acceptance and its chi-square tests are in test_sampling_exactness.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from specdeploy.runtime.errors import TreeSpecError
from specdeploy.runtime.tree import DraftTree, TreeSpec, build_buffers, select_dynamic
from specdeploy.runtime.tree_cost import CPU_COST_CURVE, choose_default_tree, expected_tokens
from specdeploy.runtime.tree_table import STATIC_TREES, parse_tree_arg
from specdeploy.runtime.verify import (
    greedy_accept,
    sample_accept,
)
from tree_strategies import (
    FAST,
    ancestors_or_self,
    assert_valid_path,
    children_of,
    draft_cases,
    longest_ok_path,
    parent_arrays,
    plain_greedy,
)

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



def test_runtime_modules_import_only_numpy():
    code = (
        "import sys, specdeploy.runtime.tree, specdeploy.runtime.verify;"
        "bad = [m for m in ('torch', 'transformers', 'scipy') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tree_choice_is_the_one_parser_of_tree_arguments():
    """Static names, chains, JSON paths and dynamic budgets, checked against a bundle's limits in one place."""
    from specdeploy.runtime.tree_table import DYNAMIC_DEFAULT_NODES, tree_choice

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
