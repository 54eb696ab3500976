"""Exact trees on the real main bundle: the seeds' tree drafts on the gathered step plan, identical to plain decoding.

The q4_1 main bundle's fused graph verifies a tree's rows otherwise than plain steps compute them on some CPUs
(siblings between a node and its ancestors move terms in the attention's sums), so there the probe keeps
chains. Its ``ort-tree`` graph gathers each row's keys in plain-step order (exporter/export/ort_gathered.py):
where the probe finds that plan's trees exact on this machine, Chimera, Medusa and Cerberus drafting 16-node
trees must give plain decoding's tokens on MT-bench first turns: the first 4 in every run, all 80 as a sweep
(``SPECDEPLOY_SWEEPS=1``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from specdeploy.runtime import load
from specdeploy.runtime.decode import DecodeStats, GenerationConfig
from specdeploy.runtime.errors import StepPlanError
from tiny_training import mtbench_first_turns

WEIGHTS = Path(__file__).resolve().parents[2] / "graphs" / "weights"
TOKENS = 24


@pytest.mark.slow
def test_tree_drafts_on_the_exact_tree_plan_equal_plain_on_4_mtbench_prompts(real_quant_bundle, plain_runs):
    _tree_drafts_equal_plain(real_quant_bundle("q4_1"), 4, plain_runs)


@pytest.mark.slow
@pytest.mark.sweep
def test_tree_drafts_on_the_exact_tree_plan_equal_plain_on_80_mtbench_prompts(real_quant_bundle, plain_runs):
    _tree_drafts_equal_plain(real_quant_bundle("q4_1"), 80, plain_runs)


def _tree_drafts_equal_plain(bundle: Path, count: int, plain_runs) -> None:
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest

    have = {d.kind for d in read_manifest(bundle).drafts}
    for kind in ("chimera", "medusa", "cerberus"):
        if kind not in have:
            export_draft(bundle, kind, WEIGHTS / f"{kind}.safetensors", progress=lambda m: None)
    try:  # the probe's verdict on this machine: the gathered plan, asked for, is refused where its chains differ
        plain = plain_runs.engine(bundle, step_plan="gathered")
    except StepPlanError as exc:
        pytest.skip(f"the gathered plan is not exact on this machine: {exc}")
    verdict = next(r for r in plain.plan.probes if r.candidate.name == "gathered")
    if not verdict.trees_exact:
        pytest.skip(f"the gathered plan's trees are not exact on this machine ({verdict.worst()}): the runtime keeps "
                    f"chains here (test_gathered.py checks that it refuses)")
    assert plain.plan.trees and plain.plan.exact
    prompts = mtbench_first_turns(count)
    assert len(prompts) == count
    refs = plain_runs.refs(bundle, prompts, TOKENS, step_plan="gathered")
    taus = {}
    for draft in ("chimera", "medusa", "cerberus-nogate"):
        with load(bundle, draft=draft, tree="tree16", step_plan="gathered") as eng:
            assert eng.plan.candidate.gathered and not eng.decoder.chains_only
            eng.decoder.drafter.always_model = True  # draft every step: trees, not the rule
            branched: list[bool] = []

            def counted(gens, cache_for, _step=eng.decoder.step, _seen=branched):
                reasons = _step(gens, cache_for)
                _seen.extend(not g.tree.is_chain for g in gens)  # the trees the step verified
                return reasons

            eng.decoder.step = counted
            tokens = steps = 0
            for ids, ref in refs:
                st = DecodeStats()
                assert eng.generate_ids(ids, GenerationConfig(TOKENS), st) == ref, (draft, ids[:8])
                tokens += st.new_tokens - 1 - st.gate_ar
                steps += st.gate_parallel
            assert sum(branched) > len(refs)  # branching trees were verified, not their best chains
            taus[draft] = tokens / steps
    print(f"tau on 16-node trees, drafting every step: {taus}")
    # trained drafts on 16-node trees (chains of the same drafts reach about 1.3-1.7 here)
    assert all(tau > 1.3 for tau in taus.values()), taus
