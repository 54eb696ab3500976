"""Trees exact by construction: the gathered step plans (``exporter/export/ort_gathered.py``, ``runtime/plan_choice.py``).

Each row of the bundle's ``ort-tree`` graph attends over its keys in the order a plain step sees them, so a
tree node's row equals the plain row of the same token: the probe checks it on this machine, the step plan
takes it where it costs little, ``step_plan`` names it, and tree drafts then equal plain decoding.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from decode_checks import OracleDrafter
from specdeploy.exporter.cli import main
from specdeploy.runtime import load
from specdeploy.runtime.decode import Decoder, DecodeStats, GenerationConfig
from specdeploy.runtime.errors import StepPlanError
from specdeploy.runtime.plan import Candidate, ProbeCheck, ProbeResult, StepPlan
from specdeploy.runtime.plan_choice import GATHERED_MAX_COST, choose
from specdeploy.runtime.probe import probe
from specdeploy.runtime.tree import DraftTree

PROMPTS = ["one two three four one two three four one two three four one two",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"]
GATHERED = Candidate("gathered", False, 1, True)


def _result(cand: Candidate, tree_gap: float, ms: float) -> ProbeResult:
    return ProbeResult(cand, (ProbeCheck("chain T=2", 0.0), ProbeCheck("tree", tree_gap)), ms)


def test_the_bundle_has_the_tree_graph_and_the_backend_offers_it(tiny_bundle):
    from specdeploy.runtime.backends import make_backend
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.plan_choice import candidates

    manifest = read_manifest(tiny_bundle)
    entry = manifest.tree_graph()
    assert entry is not None and entry.file == "base-tree.onnx" and entry.target == "ort-tree"
    with make_backend("ort-cpu", tiny_bundle, manifest) as backend:
        names = [c.name for c in candidates(backend, 16)]
        assert names[-3:] == ["gathered", "gathered-two-rows", "gathered-padded-16"]
        assert backend.graphs(False, gathered=True) == (backend.graph, entry)
        backend.release_unused()  # a plan that does not gather frees it
        assert not backend.can_gather and "gathered" not in [c.name for c in candidates(backend, 16)]


def test_gathered_trees_are_exact_where_the_fused_ones_may_not_be(tiny_bundle):
    """The probe's tree puts a sibling before every node of its path: on the gathered graph each path row equals
    the plain row bit for bit, at both contexts (the fused graph's may differ: that is this CPU's business)."""
    with load(tiny_bundle, draft=None, step_plan="gathered") as engine:
        res = probe(engine.backend, engine.manifest, GATHERED, depth=16)
        trees = [c for c in res.checks if c.what.startswith("tree")]
        assert res.trees_exact and [c.what for c in trees] == ["tree", "tree @200"], res.checks
        assert engine.plan.candidate == GATHERED and engine.plan.trees and engine.plan.exact


def test_the_tree_graph_is_used_for_steps_and_the_fused_one_for_long_prefills(tiny_bundle):
    with load(tiny_bundle, draft=None, step_plan="gathered") as engine:
        backend = engine.backend
        backend.graph_steps.clear()  # the probe's steps
        ids = engine.encode(PROMPTS[0] * 6)
        assert len(ids) > engine.manifest.limits.max_tree
        engine.generate_ids(ids, GenerationConfig(4))
        assert backend.graph_steps == {"base": 1, "tree": 3}  # the long prefill, then every decode step


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_drafts_on_the_gathered_plan_equal_plain_decoding(tiny_bundle, seed):
    """Random trees whose true path runs through arbitrary branches (the oracle of test_decode), on the
    gathered plan: identical to plain decoding on that plan, accepting paths with siblings between their
    nodes; and prompt lookup's trees too."""
    from specdeploy.runtime.drafters import PromptLookupDrafter

    with load(tiny_bundle, draft=None, step_plan="gathered") as engine:
        assert engine.plan.trees and engine.plan.candidate.gathered
        plain = Decoder(engine.backend, engine.manifest, None, plan=engine.plan)
        for text in PROMPTS:
            ids = engine.encode(text)
            ref = list(plain.generate(ids, GenerationConfig(40)))
            for drafter in (OracleDrafter(len(ids), ref, max_nodes=16, seed=seed), PromptLookupDrafter(branches=3)):
                spec = Decoder(engine.backend, engine.manifest, drafter, plan=engine.plan)
                stats = DecodeStats()
                assert list(spec.generate(ids, GenerationConfig(40), stats)) == ref, type(drafter).__name__
            assert stats.steps < 39  # prompt lookup speculated


def test_choose_takes_exact_trees_only_at_a_small_plain_step_cost():
    one = Candidate("one-graph", False, 1)
    chains = _result(one, 1e-6, 5.0)
    cheap = choose([chains, _result(GATHERED, 0.0, 5.0 * GATHERED_MAX_COST * 0.99)], 16)
    assert cheap.candidate == GATHERED and cheap.trees and cheap.exact
    dear = choose([chains, _result(GATHERED, 0.0, 6.5)], 16)
    assert dear.candidate == one and not dear.trees and "'gathered' is exact but its plain step costs 1.3x" in dear.reason
    both = choose([_result(one, 0.0, 5.0), _result(GATHERED, 0.0, 5.0)], 16)  # fused trees exact: no need
    assert both.candidate == one and both.trees
    only = choose([ProbeResult(one, (ProbeCheck("chain T=2", 0.5),), 5.0), _result(GATHERED, 0.0, 5.5)], 16)
    assert only.candidate == GATHERED and only.speculate  # the one exact plan, at 1.1x the fastest


def test_choose_puts_rows_that_batch_first_and_states_the_tax():
    one = Candidate("one-graph", False, 1)
    rows = ProbeResult(GATHERED, (ProbeCheck("chain T=2", 0.0), ProbeCheck("tree", 0.0),
                                  ProbeCheck("batch rows: 6 sequences, plain", 0.0)), 6.5)
    picked = choose([_result(one, 1e-6, 5.0), rows], 16)  # 1.3x the fastest: more than trees alone may cost
    assert picked.candidate == GATHERED and picked.rows and picked.trees and picked.exact
    assert "1.30x the fastest plan's plain step (the exactness tax)" in picked.reason
    assert "one answer at any load" in picked.reason
    lone = choose([_result(one, 1e-6, 5.0), rows], 16, rows_first=False)  # step_plan 'lone': the tax's baseline
    assert lone.candidate == one and not lone.rows
    differ = ProbeResult(GATHERED, (*rows.checks[:2], ProbeCheck("batch rows: 6 sequences, plain", 2e-7)), 5.2)
    assert not choose([_result(one, 1e-6, 5.0), differ], 16).rows  # a row that differs among others: no batching


def test_a_named_plan_is_probed_and_refused_where_it_is_not_exact(tiny_bundle, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    with pytest.raises(StepPlanError, match="has no 'fastest' step plan for this bundle; it has split|one-graph"):
        load(tiny_bundle, draft=None, step_plan="fastest")
    from specdeploy.runtime import probe as probe_mod

    differs = lambda backend, manifest, cand, depth: ProbeResult(cand, (ProbeCheck("chain T=3", 0.125),), 1.0)
    monkeypatch.setattr(probe_mod, "probe", differs)
    with pytest.raises(StepPlanError, match="'gathered' step plan is not exact on this machine .* by 0.12 at chain T=3"):
        load(tiny_bundle, draft=None, step_plan="gathered")
    with load(tiny_bundle, draft="prompt-lookup", step_plan="gathered", allow_inexact=True) as engine:
        assert engine.plan.lossy and engine.plan.reason.startswith("LOSSY")
    result = CliRunner().invoke(main, ["generate", str(tiny_bundle), "--prompt", "hi", "--max-new-tokens", "2",
                                       "--step-plan", "gathered"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "'gathered' step plan is not exact on this machine" in result.output


def test_cached_verdicts_without_the_gathered_field_still_read(tmp_path, monkeypatch):
    from specdeploy.runtime.verdicts import cached_verdict

    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    old = {"candidate": {"name": "one-graph", "split": False, "min_rows": 1},
           "checks": [{"what": "chain T=2", "max_abs": 0.0}], "plain_ms": 1.0}
    (tmp_path / "exactness.json").write_text(json.dumps({"k": old}))
    res = cached_verdict("k")
    assert res is not None and res.candidate == Candidate("one-graph", False, 1) and not res.candidate.gathered


def test_a_tree_row_equals_the_plain_row_with_its_siblings_between(tiny_bundle):
    """A direct check of the construction: node 3 (under node 1, with node 2 a sibling between them) computes
    the plain row of its token after its parent, bit for bit, on the gathered plan."""
    with load(tiny_bundle, draft=None, step_plan="gathered") as engine:
        dec = Decoder(engine.backend, engine.manifest, None,
                      plan=StepPlan(GATHERED, True, True, True, 16, "forced"))
        state, _ = dec.prefill(engine.encode(PROMPTS[1]))
        p = state.cache.length
        state.cache.ensure_capacity(p + 8, dec.buckets)
        tree = DraftTree(np.array([7, 8, 9, 10]), np.array([-1, 0, 0, 1]))
        got = dec.verify(state, tree, tree.buffers())
        rows = [got.logits[0, 0].copy(), got.logits[0, 1].copy(), got.logits[0, 3].copy()]
        plain = []
        for i, tok in enumerate([7, 8, 10]):
            state.cache.length = p + i
            out = dec.verify(state, DraftTree.root(tok), DraftTree.root(tok).buffers())
            plain.append(out.logits[0, 0])
        for a, b in zip(rows, plain):
            assert np.array_equal(a, b)
