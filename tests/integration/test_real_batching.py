"""The main job's bundle (SmolLM2 as its Q4_1 blocks, with the shipped Chimera): every answer is the one ``generate``
gives plainly, at max_batch 1, 4 and 32, with ``auto`` and with the trained draft, and sequences draft in a batch,
from their recall too where the load gate runs the steps plain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from decode_checks import concurrently
from specdeploy.runtime import load
from specdeploy.runtime.batch import BatchScheduler


@pytest.mark.slow
def test_every_answer_is_the_same_at_any_load_with_auto_and_a_trained_draft(real_quant_bundle, plain_runs, monkeypatch):
    from specdeploy.exporter.bench.run import default_prompts_file
    from specdeploy.exporter.export.draft import export_draft

    out = real_quant_bundle("q4_1")
    weights = Path(__file__).resolve().parents[2] / "graphs" / "weights" / "chimera.safetensors"
    export_draft(out, "chimera", weights, progress=lambda m: None)  # as the main job has it (nothing to do if there)
    turns = [json.loads(line)["turns"][0] for line in default_prompts_file().read_text().splitlines()[:4]]
    msgs = [[{"role": "user", "content": t}] for t in turns]
    kw = {"max_new_tokens": 32}
    want = [ref for _, ref in plain_runs.refs(out, turns, kw["max_new_tokens"])]  # generate, plainly, one at a time
    for draft, max_batch in (("auto", 1), ("auto", 4), ("auto", 32), ("chimera", 4)):
        if draft == "chimera":  # it drafts every step, and the batch verifies its chains whole: exactness with drafts
            # in the batch, whatever this machine's step and call costs would let pay (tested elsewhere)
            monkeypatch.setattr("specdeploy.runtime.drafters.hybrid.HybridDrafter.always_model", True)
            monkeypatch.setattr("specdeploy.runtime.batch.measure_cost_curve",
                                lambda decoder, largest=None: {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08, 32: 1.16})
        with load(out, draft=draft, max_batch=max_batch) as eng:
            got = concurrently(eng, [None] * len(msgs), messages_list=msgs, **kw)
            batching = isinstance(eng.scheduler, BatchScheduler)
            assert batching == (max_batch > 1 and eng.plan.rows), eng.batch_reason
            assert eng.fingerprint.endswith("-exact")
        assert [list(g.token_ids) for g in got] == want, (draft, max_batch, eng.plan.reason, eng.batch_reason)
        if batching and draft == "chimera":  # the trained draft drafted inside the batch
            assert max(max(g.stats.tree_sizes) for g in got) > 1


@pytest.mark.slow
def test_steps_the_load_gate_runs_plain_draft_answers_met_before_from_the_recall(real_quant_bundle, plain_runs,
                                                                                 monkeypatch):
    """The gate held plain at every load: only the suffix cache's recall may draft. Asked again, the answers are
    drafted from the cache inside the batch, and every one is still ``generate``'s plain answer."""
    from specdeploy.exporter.bench.run import default_prompts_file
    from specdeploy.runtime.rows import LoadGate

    out = real_quant_bundle("q4_1")
    turns = [json.loads(line)["turns"][0] for line in default_prompts_file().read_text().splitlines()[4:8]]
    msgs = [[{"role": "user", "content": t}] for t in turns]
    kw = {"max_new_tokens": 32}
    want = [ref for _, ref in plain_runs.refs(out, turns, kw["max_new_tokens"])]
    monkeypatch.setattr(LoadGate, "drafting", lambda self, batch: False)
    monkeypatch.setattr("specdeploy.runtime.batch.measure_cost_curve",  # draft rows pay, whatever this machine's
                        lambda decoder, largest=None: {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08, 32: 1.16})
    with load(out, draft="auto", max_batch=4) as eng:
        if not isinstance(eng.scheduler, BatchScheduler):
            pytest.skip(f"no batching on this machine: {eng.batch_reason}")
        rounds = [concurrently(eng, [None] * len(msgs), messages_list=msgs, **kw) for _ in range(2)]
    for got in rounds:
        assert [list(g.token_ids) for g in got] == want
    drafted = [max(g.stats.tree_sizes, default=1) > 1 for g in rounds[1]]
    assert sum(drafted) >= 2, [g.stats.tree_sizes for g in rounds[1]]  # the recall drafted the answers met before
    assert sum(g.stats.steps for g in rounds[1]) < sum(g.stats.steps for g in rounds[0])  # in fewer steps
