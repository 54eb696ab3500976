"""A manifest graph against a draft graph's contract (runtime/draft_contract.py), for the draft tests."""

from __future__ import annotations

from specdeploy.runtime.draft_contract import GraphContract


def follows(graph, contract: GraphContract, fused: bool = False) -> None:
    """``graph`` (a manifest GraphEntry) has ``contract``'s inputs and outputs."""
    inputs = [t for t in contract.inputs if fused or not t.fused_only]
    for got, want in ((graph.inputs, inputs), (graph.outputs, contract.outputs)):
        assert [(t.name, t.dtype, len(t.shape)) for t in got] == [(t.name, t.dtype, len(t.dims)) for t in want], \
            graph.role
