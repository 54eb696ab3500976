"""The shipped drafts and the suffix drafter on the real SmolLM2 bundles: parity, greedy identity, tau."""

from __future__ import annotations

from pathlib import Path

import pytest
from decode_checks import suffix_identity
from specdeploy.exporter.export.ngram import calibrate, read_replies
from specdeploy.exporter.train.weights import load_draft_weights
from specdeploy.runtime import load
from specdeploy.runtime.bundle import read_manifest
from specdeploy.runtime.decode import DecodeStats, GenerationConfig
from tiny_training import graph_files as _graph_files
from tiny_training import mtbench_first_turns

WEIGHTS = Path(__file__).resolve().parents[2] / "graphs" / "weights"
SHIPPED_REPLIES = WEIGHTS / "self-replies.npz"
DRAFT_TOKENS = 32  # per prompt, in the shipped drafts' identity and tau
SUFFIX_PROMPTS = ["Fill in the form: name Ann, age 31, city Oslo. Reply as JSON with keys name, age, city.",
                  "Fill in the form: name Bob, age 42, city Rome. Reply as JSON with keys name, age, city.",
                  "one two three four one two three four one two"]


def _drafting_tau(eng, refs, what) -> float:
    """Tokens per step over the steps ``eng`` drafted (the rule runs the others plainly), each output held to
    plain decoding's."""
    tokens = steps = 0
    for ids, ref in refs:
        st = DecodeStats()
        assert eng.generate_ids(ids, GenerationConfig(DRAFT_TOKENS), st) == ref, what
        tokens += st.new_tokens - 1 - st.gate_ar
        steps += st.gate_parallel
    return tokens / steps


@pytest.mark.slow
def test_shipped_chimera_on_the_real_model(real_bundle, drafted, plain_runs):
    """Export the shipped weights, validate parity, greedy identity on 3 MT-bench prompts x 32 tokens."""
    bundle, checks = drafted
    w = load_draft_weights(WEIGHTS / "chimera.safetensors", "chimera")
    assert (WEIGHTS / "chimera.safetensors").stat().st_size <= 30 * 2**20
    # trained on the base model's own replies to 5120 ShareGPT first turns, fusing EAGLE-3's low, mid and
    # high base layers (graphs/weights/README.md); the real bundle taps them (integration/conftest.py: SHIPPED_TAPS)
    assert w.config.num_heads == 4 and w.meta["data"]["tokens"] > 1_000_000
    assert w.config.feature_layers == (1, 14, 26)
    assert w.meta["data"]["config"]["replies"] == "self"
    from specdeploy.exporter.export.shared_data import stored_twice

    assert stored_twice(bundle, _graph_files(bundle)) == []  # the trt and ort graphs share their fp32 weights
    assert all(c.passed for c in checks) and {c.case for c in checks} >= {"chimera", "chimera-int4"}
    refs = plain_runs.refs(real_bundle, mtbench_first_turns(3), DRAFT_TOKENS)  # the copy's base is the session bundle's
    for tree in (None, "tree16", "dynamic:16"):
        with load(bundle, draft="chimera", tree=tree) as eng:
            plain_runs.same_plan(real_bundle, eng)
            eng.decoder.drafter.always_model = True  # what it learned: it drafts every step
            tau = _drafting_tau(eng, refs, tree)
            # An untrained draft stays near 1.0. The adaptive chain is sized by the cost curve measured at
            # load, so tau moves with the machine's timing (1.28 in one CI run on the AMD EPYC, above 1.3 in others).
            assert tau > 1.2, (tree, tau)


@pytest.mark.slow
def test_shipped_heads_on_the_real_model(real_bundle, drafted, plain_runs):
    """Export the shipped weights, validate parity, greedy identity on 3 MT-bench prompts x 32 tokens."""
    bundle, checks = drafted
    assert all(c.passed for c in checks) and {c.case for c in checks} >= {"medusa", "medusa-int4", "cerberus",
                                                                          "cerberus-int4", "cerberus-gate"}
    refs = plain_runs.refs(real_bundle, mtbench_first_turns(3), DRAFT_TOKENS)
    # The calibrated defaults (tree, vocabulary, gate) and a 16-node tree, whose tau shows the heads learned.
    for draft, tree in (("medusa", None), ("cerberus", None), ("medusa", "tree16"), ("cerberus-nogate", "tree16")):
        with load(bundle, draft=draft, tree=tree) as eng:
            plain_runs.same_plan(real_bundle, eng)
            if tree == "tree16":  # what the heads learned: they draft every step, the rule set aside
                eng.decoder.drafter.always_model = True
            tau = _drafting_tau(eng, refs, (draft, tree))
            if tree == "tree16":  # a chains-only step plan verifies the tree's best chain only
                assert tau > (1.3 if eng.plan.trees else 1.1), (draft, tau, eng.plan.reason)


@pytest.mark.slow
def test_the_shipped_replies_make_a_table_that_predicts_held_out_replies(real_bundle, tmp_path):
    """The embedded model's committed self-replies: their table, and its held-out top-1 (measured 0.36)."""
    replies = read_replies(SHIPPED_REPLIES, 49152, read_manifest(real_bundle).source.weight_sha)
    assert len(replies) == 5120 and sum(len(r) for r in replies) > 900_000
    _, stats = calibrate(replies[:1024], 49152)
    assert stats["heldout_top1"] > 0.25


@pytest.mark.slow
def test_suffix_drafts_equal_plain_decoding_on_the_real_model(real_quant_bundle):
    stats = suffix_identity(real_quant_bundle("q4_1"), SUFFIX_PROMPTS, 48)
    if all(s.steps for s in stats):
        repeat, first = stats[3], stats[0]  # the same request again: its answer is in the cache
        assert repeat.steps < first.steps
