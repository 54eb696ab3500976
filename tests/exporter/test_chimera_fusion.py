"""Chimera on the real model with the shipped weights, the hybrid (lookup + Chimera in one tree), and
EAGLE-3-style layer fusion. The graph, training and drafter on tiny configs: ``test_chimera.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from specdeploy.exporter.train.data import build_cache
from specdeploy.exporter.train.modules import chimera_from_weights
from specdeploy.exporter.train.weights import load_draft_weights, train
from specdeploy.graphs.chimera import ChimeraDraft
from specdeploy.runtime import load
from specdeploy.runtime.decode import DecodeStats, GenerationConfig
from specdeploy.runtime.errors import DraftMismatchError, TrainingError
from tiny_training import CHIMERA_LOOP as TINY_LOOP
from tiny_training import TINY_CHIMERA as TINY
from tiny_training import TINY_DATA
from tiny_training import chimera_task as _task

WEIGHTS = Path(__file__).resolve().parents[2] / "graphs" / "weights"


def test_draft_sessions_run_on_one_thread_without_spinning(chimera_bundle):
    """Draft and base sessions share the cores: a spinning draft pool measured 2x slower tree steps."""
    with load(chimera_bundle, draft="chimera") as eng:
        opts = eng.decoder.drafter.model.session.get_session_options()
        assert opts.intra_op_num_threads == 1
        assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"


# --- hybrid: prompt lookup + the Chimera draft in one tree ------------------------------------------
@pytest.mark.parametrize("plan_trees", [True, False])
def test_hybrid_matches_plain_greedy_and_uses_both_sources(chimera_bundle, plan_trees):
    """Identical to plain greedy, with trees and on a chains-only plan; lookup drafts where the text
    repeats, the model elsewhere."""
    import dataclasses

    from specdeploy.runtime.decode import Decoder
    from specdeploy.runtime.drafters import make_drafter

    prompts = ["The cat sat on the mat. The cat sat on the mat. The cat", "Tell me about the weather in Paris",
               "1 2 3 4 5 6 7 8 1 2 3 4"]
    with load(chimera_bundle, draft=None) as plain:
        plan = dataclasses.replace(plain.plan, trees=plan_trees)
        hybrid = make_drafter("hybrid", chimera_bundle, plain.manifest, chains=not plan_trees)
        assert hybrid.kind == "hybrid:chimera"
        dec = Decoder(plain.backend, plain.manifest, hybrid, plan=plan)
        ref = Decoder(plain.backend, plain.manifest, plan=plan)
        for prompt in prompts:
            ids = plain.encode(prompt)
            stats = DecodeStats()
            got = list(dec.generate(ids, GenerationConfig(32), stats))
            assert got == list(ref.generate(ids, GenerationConfig(32))), prompt
            assert stats.mean_accepted >= 1.0
        assert hybrid.sources["lookup"] > 0 and hybrid.sources["model"] > 0, hybrid.sources


def test_hybrid_tree_puts_lookup_first_and_merges_the_model_under_the_budget():
    from specdeploy.runtime.drafters.base import DraftContext, Drafter
    from specdeploy.runtime.drafters.hybrid import HybridDrafter, _merge
    from specdeploy.runtime.tree import DraftTree

    lookup = DraftTree(np.array([9, 1, 2, 3]), np.array([-1, 0, 1, 2]))
    model = DraftTree(np.array([9, 1, 5, 7, 8]), np.array([-1, 0, 1, 0, 3]))  # shares token 1 under the root
    merged = _merge(lookup, model, max_nodes=6)
    assert merged.tokens.tolist() == [9, 1, 2, 3, 5, 7] and merged.parents.tolist() == [-1, 0, 1, 2, 1, 0]
    assert merged.main_path().tokens.tolist() == [9, 1, 2, 3]  # lookup's chain is the main path

    class Model(Drafter):
        kind = "stub"
        seen = 0  # base states handed to the model

        def propose(self, ctx):
            self.seen += len(ctx.hidden)
            return DraftTree(np.array([ctx.tokens[-1], 42]), np.array([-1, 0]))

    stub = Model()
    hybrid = HybridDrafter(stub, chains=True)
    h = lambda rows: np.zeros((rows, 4), np.float32)
    # No lookup match, and a model not yet known to be poor: it drafts.
    assert hybrid.propose(DraftContext(np.array([5, 6, 7]), h(3), None, 8)).tokens.tolist() == [7, 42]
    assert stub.seen == 3
    hybrid.accepted(np.array([0]), DraftTree.root(7))
    hybrid.model_acceptance.first = [1.0, 50.0]  # the model's drafts have been rejected: it no longer pays
    tree = hybrid.propose(DraftContext(np.array([5, 6, 7, 5, 6]), h(2), None, 8))
    assert tree.is_chain and tree.tokens.tolist()[:2] == [6, 7] and stub.seen == 3  # lookup; the model idle
    hybrid.accepted(np.array([0, 1]), tree)
    tree = hybrid.propose(DraftContext(np.array([5, 6, 7, 5, 6, 7, 9]), h(2), None, 8))
    assert tree.tokens.tolist() == [9] and stub.seen == 3  # no match, and the model does not pay: plain
    hybrid.accepted(np.array([0]), tree)
    hybrid.model_acceptance.first = [20.0, 1.0]  # it pays again
    hybrid.timer.call_s, hybrid.timer.step_s = 1e-4, 1e-2  # its call timed at 1% of a step (not this machine's noise)
    assert hybrid.propose(DraftContext(np.array([5, 6, 7, 5, 6, 7, 9, 11]), h(1), None, 8)).tokens.tolist() == [11, 42]
    assert stub.seen == 3 + 2 + 2 + 1  # the states accepted while it idled reach it in one call
    assert hybrid.sources == {"lookup": 1, "model": 2, "plain": 1}


def test_hybrid_names(chimera_bundle):
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters import make_drafter
    from specdeploy.runtime.errors import DraftMismatchError as Mismatch

    manifest = read_manifest(chimera_bundle)
    with pytest.raises(Mismatch, match="the hybrid's model must be one of"):
        make_drafter("hybrid:nope", chimera_bundle, manifest)
    with pytest.raises(Mismatch, match="medusa"):  # the bundle has no Medusa heads
        make_drafter("hybrid:medusa", chimera_bundle, manifest)


# --- EAGLE-3-style layer fusion (training side) --------------------------------------------------------------
def test_layer_fusion_starts_near_the_deepest_tap_normalised():
    from specdeploy.graphs.base_step import rms_norm
    from specdeploy.graphs.chimera import LayerFusion, default_feature_layers

    assert default_feature_layers(30) == (1, 14, 26)  # EAGLE-3's low, mid and high taps on SmolLM2
    with pytest.raises(ValueError):
        default_feature_layers(3)
    torch.manual_seed(0)
    fusion = LayerFusion(64, 3, 1e-5)
    taps = torch.randn(5, 3 * 64) * torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(64)  # scales grow with depth
    out = fusion(taps)
    deepest = rms_norm(taps[:, 128:], torch.ones(64), 1e-5)
    assert torch.nn.functional.cosine_similarity(out, deepest, dim=-1).min() > 0.9


def test_a_fusing_draft_reads_the_tapped_layers_at_its_real_slots():
    from dataclasses import replace

    cfg = replace(TINY, feature_layers=[0, 1])
    assert cfg.feature_layers == (0, 1)
    torch.manual_seed(0)
    draft = ChimeraDraft(cfg).eval()
    emb, hidden = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    layers = torch.randn(1, 6, 32)
    with torch.no_grad():
        a = draft.unrolled(emb, hidden, 2, layers)
        b = draft.unrolled(emb, hidden, 2, layers * 2 + 1)
    assert not torch.allclose(a[0], b[0])
    with pytest.raises(ValueError, match="pass their states"):
        draft.unrolled(emb, hidden, 2)
    assert ChimeraDraft(TINY).fusion is None  # a plain Chimera has no fusion weights


@pytest.fixture(scope="module")
def fused_setup(tiny_model_factory, tmp_path_factory):
    """A tiny cache with layer 0's states and a draft trained to fuse them."""
    from dataclasses import replace

    from specdeploy.exporter.source import load_model

    loaded = load_model(str(tiny_model_factory("llama")))
    tmp = tmp_path_factory.mktemp("fused")
    cache = build_cache(loaded, tmp / "data", replace(TINY_DATA, feature_layers=(0,)), show_progress=False)
    out = tmp / "fused.safetensors"
    torch.manual_seed(0)
    train(_task((loaded, cache), feature_layers=(0,)), out, TINY_LOOP, show_progress=False, log=lambda m: None)
    return loaded, cache, out


def test_training_a_fusing_draft_on_a_cache_with_layer_states(fused_setup, tmp_path):
    loaded, cache, out = fused_setup
    from dataclasses import replace

    assert replace(TINY_DATA, feature_layers=(0,)).key() != TINY_DATA.key()
    h = loaded.model.config.hidden_size
    assert cache.layers.shape == (cache.num_tokens, h) and cache.layers.dtype == np.float16
    with torch.no_grad():  # layer 0's residual output, as transformers computes it
        seq = torch.from_numpy(np.asarray(cache.tokens[: cache.offsets[1]], dtype=np.int64))[None]
        ref = loaded.model.model(input_ids=seq, output_hidden_states=True).hidden_states[1][0]
    np.testing.assert_allclose(cache.layers[: cache.offsets[1]].astype(np.float32), ref.numpy(), rtol=2e-3, atol=2e-3)
    plain_cache = build_cache(loaded, tmp_path / "plain", TINY_DATA, show_progress=False)
    assert plain_cache.layers is None
    with pytest.raises(TrainingError, match="build the data with the same --feature-layers"):
        _task((loaded, plain_cache), feature_layers=(0,))
    task = _task((loaded, cache), feature_layers=(0,))
    torch.manual_seed(0)
    idx = np.arange(task.num_examples())
    before = float(task.loss(task.build(), idx)[0].detach())
    w = load_draft_weights(out, "chimera")
    assert w.config.feature_layers == (0,)
    assert float(task.loss(chimera_from_weights(w), idx)[0].detach()) < before


def test_base_graphs_output_the_tapped_layers_and_keep_their_other_outputs(tiny_model_factory, tiny_bundle, tmp_path):
    from specdeploy.exporter.export.base import export_base
    from specdeploy.runtime.backends.ort import OrtBackend
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.decode import Decoder
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.plan import Candidate, StepPlan

    model_dir = tiny_model_factory("llama")
    with pytest.raises(SpecDeployError, match="--feature-layers: feature layers must increase"):
        export_base(str(model_dir), tmp_path / "bad", max_context=128, feature_layers="1", progress=lambda m: None)
    bundle = tmp_path / "taps"
    export_base(str(model_dir), bundle, max_context=512, max_tree=64, feature_layers="0", progress=lambda m: None)
    manifest, plain = read_manifest(bundle), read_manifest(tiny_bundle)
    bases = [g for g in manifest.graphs if g.role == "base"]
    assert {g.target for g in bases} == {"trt", "ort", "ort-tree"} and all(g.feature_layers == (0,) for g in bases)
    assert all(any(o.name == "layer_states" for o in g.outputs) for g in bases)
    from specdeploy.exporter.source import load_model

    hf = load_model(str(model_dir)).model
    ids = [3, 17, 5, 9, 11, 2]
    with torch.no_grad():
        ref = hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0].numpy()
    for graph in bases:
        outs = []
        for m in (manifest, plain):
            entry = next(g for g in m.graphs if g.role == "base" and g.target == graph.target)
            backend = OrtBackend(bundle if m is manifest else tiny_bundle, m, graph=entry)
            plan = StepPlan(Candidate("one-graph", False, 1), True, True, True, 16, "test")
            _, out = Decoder(backend, m, plan=plan).prefill(ids)
            outs.append(out)
        tapped, untapped = outs
        assert untapped.layer_states is None
        np.testing.assert_allclose(tapped.layer_states[0], ref, atol=1e-4, rtol=1e-4)
        np.testing.assert_array_equal(tapped.logits, untapped.logits)
        np.testing.assert_array_equal(tapped.hidden_states, untapped.hidden_states)


def test_a_fusing_draft_exports_to_a_tapped_bundle_only_and_stays_lossless(fused_setup, tiny_model_factory,
                                                                          tiny_bundle, tmp_path):
    from specdeploy.exporter.check.validate import compare_drafts
    from specdeploy.exporter.export.base import export_base
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest

    loaded, _, weights = fused_setup
    plain = tmp_path / "plain"
    shutil.copytree(tiny_bundle, plain)
    with pytest.raises(DraftMismatchError, match="re-export the base with --feature-layers 0"):
        export_draft(plain, "chimera", weights, progress=lambda m: None)
    bundle = tmp_path / "taps"
    export_base(str(tiny_model_factory("llama")), bundle, max_context=512, max_tree=64, feature_layers="0",
                progress=lambda m: None)
    export_draft(bundle, "chimera", weights, progress=lambda m: None)
    manifest = read_manifest(bundle)
    entry = manifest.draft("chimera")
    assert entry.setting("feature_layers") == "0"
    assert {"layer_states", "from_layers"} <= {i.name for g in entry.graphs for i in g.inputs}
    checks = compare_drafts(bundle, manifest, loaded, list(range(100, 116)), progress=lambda m: None)
    assert checks and all(c.passed for c in checks), checks
    prompts = ["Hello there, how are you today?", "1 2 3 4 5 6 7 8", "The cat sat on the mat. The cat"]
    for draft in ("chimera", "hybrid"):
        with load(bundle, draft=None) as base, load(bundle, draft=draft, tree="chain4") as spec:
            for p in prompts:
                ids = base.encode(p)
                st = DecodeStats()
                assert spec.generate_ids(ids, GenerationConfig(40), st) == base.generate_ids(ids, GenerationConfig(40))
                assert st.steps >= 1


def test_bf16_autocast_only_where_bf16_matmuls_are_fast(tiny_setup, monkeypatch):
    """On a CPU without AMX or AVX-512 BF16 torch emulates bf16: training there runs fp32 unless asked."""
    from specdeploy.exporter.train.options import bf16_fast

    for amx, avx512_bf16, fast in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert bf16_fast("cpu") is fast
        task = _task(tiny_setup)
        assert task.bf16 is fast and task.train_weight.dtype == (torch.bfloat16 if fast else torch.float32)
        assert task.train_weight32.dtype == torch.float32
        forced = _task(tiny_setup, bf16=not fast)
        assert forced.bf16 is (not fast) and forced.to("cpu").train_weight.dtype == (
            torch.float32 if fast else torch.bfloat16)
    assert bf16_fast("meta") is False


def test_a_fusing_draft_on_a_backend_without_layer_states_is_one_sentence(fused_setup, tiny_model_factory, tmp_path,
                                                                          monkeypatch):
    from specdeploy.exporter.export.base import export_base
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.backends.ort import OrtBackend

    bundle = tmp_path / "taps"
    export_base(str(tiny_model_factory("llama")), bundle, max_context=512, max_tree=64, feature_layers="0",
                progress=lambda m: None)
    export_draft(bundle, "chimera", fused_setup[2], progress=lambda m: None)
    real = OrtBackend.__init__

    def without(self, *a, **k):
        real(self, *a, **k)
        self.layer_states = False

    monkeypatch.setattr(OrtBackend, "__init__", without)
    with pytest.raises(DraftMismatchError, match=r"reads base layers \[0\], which the ort-cpu backend does not"):
        load(bundle, draft="chimera")
