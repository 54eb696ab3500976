"""Hypothesis strategies for draft trees and the naive references the tree and acceptance tests check against."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from specdeploy.runtime.tree import DraftTree

FAST = settings(max_examples=150, deadline=None)


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


