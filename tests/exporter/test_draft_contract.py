"""The draft graphs' contract (runtime/draft_contract.py): the traced modules take its inputs, and the graphs an
export writes have exactly its inputs and outputs, in order, with its dtypes and ranks."""

from __future__ import annotations

import inspect

import pytest
from contract_checks import follows
from specdeploy.runtime.draft_contract import CHIMERA_STEP, GATE, HEADS


def test_the_traced_modules_take_the_contracts_inputs():
    """The exporter names a graph's inputs after the contract and keys its dynamic shapes by them, which
    ``torch.export`` matches to the module's forward arguments."""
    from specdeploy.graphs.chimera import ChimeraStepGraph, FusedChimeraStepGraph
    from specdeploy.graphs.gate import GateGraph
    from specdeploy.graphs.heads import DraftHeadsGraph

    for module, contract, fused in ((DraftHeadsGraph, HEADS, False), (GateGraph, GATE, False),
                                    (ChimeraStepGraph, CHIMERA_STEP, False),
                                    (FusedChimeraStepGraph, CHIMERA_STEP, True)):
        args = tuple(inspect.signature(module.forward).parameters)[1:]
        assert args == contract.input_names(fused), module.__name__


def test_dynamic_axes_name_only_the_dynamic_dimensions():
    axes = CHIMERA_STEP.dynamic_axes()
    assert axes["attention_mask"] == {0: "batch", 2: "rows", 3: "capacity"}
    assert axes["head_index"] is None and "layer_states" not in axes
    assert CHIMERA_STEP.dynamic_axes(fused=True)["from_layers"] is None
    assert HEADS.dynamic_axes() == {"hidden_states": {0: "batch", 1: "rows"}}
    assert GATE.output_names == ("entropy", "gate_prob")


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_an_exported_chimera_draft_follows_the_contract(chimera_bundle, chimera_weights, tmp_path, precision):
    import shutil

    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest

    bundle = chimera_bundle
    if precision != "int4":  # the fixture's default; another precision on a copy
        bundle = tmp_path / "b"
        shutil.copytree(chimera_bundle, bundle)
        export_draft(bundle, "chimera", chimera_weights, progress=lambda m: None, precision=precision)
    entry = read_manifest(bundle).draft("chimera")
    assert entry.graphs
    for graph in entry.graphs:
        follows(graph, CHIMERA_STEP)
