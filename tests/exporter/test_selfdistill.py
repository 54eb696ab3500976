"""The self-distillation data engine: batched greedy replies, hidden states and labels through the runtime."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from specdeploy.exporter.train.data import DataConfig, build_cache
from specdeploy.exporter.train.selfdistill import RuntimeGenerator, load_replies, save_replies
from specdeploy.runtime import load
from specdeploy.runtime.decode import GenerationConfig
from specdeploy.runtime.errors import TrainingError

SELF_DATA = DataConfig(max_seqs=6, max_len=96, min_assistant_tokens=4, heldout_fraction=0.3, shard_size=3,
                       replies="self", reply_tokens=12)


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tiny_bundle):
    from specdeploy.exporter.source import load_model

    return load_model(str(tiny_model_factory("llama"))), tiny_bundle


def _prompts(engine) -> list[np.ndarray]:
    texts = ["Hello there, how are you today?", "1 2 3", "The cat sat on the mat. The cat sat on the"]
    return [np.asarray(engine.encode(t), dtype=np.int32) for t in texts]


def test_one_batched_pass_gives_plain_greedy_replies_their_hidden_states_and_labels(setup):
    _, bundle = setup
    gen = RuntimeGenerator(bundle, threads=2)
    with load(bundle, draft=None) as plain:
        prompts = _prompts(plain)
        seqs = gen.generate(prompts, max_new_tokens=10)
        for p, q in zip(prompts, seqs):
            reply = plain.generate_ids(p.tolist(), GenerationConfig(10))
            reply = reply[: next((i + 1 for i, t in enumerate(reply) if t in gen.eos), len(reply))]
            assert q.ids.tolist() == p.tolist() + reply  # left padding and batching change nothing
            assert q.mask.tolist() == [0] * len(p) + [1] * len(reply)
            # the hidden states are those of one teacher-forced prefill over the whole sequence
            state, _ = plain.decoder.prefill(q.ids.tolist())
            np.testing.assert_allclose(q.hidden.astype(np.float32), state.hidden, atol=2e-2, rtol=1e-2)
            # greedy labels: each reply-predicting position's label is the token that followed it
            assert q.labels[len(p) - 1 : -1].tolist() == reply
        features = gen.features([(q.ids, q.mask) for q in seqs])  # teacher-forced, from the ids alone
        for q, f in zip(seqs, features):
            n = int(np.argmax(q.mask)) - 1
            assert f.labels[n:].tolist() == q.labels[n:].tolist()
            np.testing.assert_allclose(f.hidden.astype(np.float32), q.hidden.astype(np.float32), atol=2e-2)


def test_finished_rows_leave_the_batch_and_the_others_go_on(setup):
    _, bundle = setup
    gen = RuntimeGenerator(bundle, threads=2)
    with load(bundle, draft=None) as plain:
        prompts = _prompts(plain)
    gen.eos = frozenset()
    full = gen.generate(prompts, max_new_tokens=8)
    stop = int(full[0].ids[len(prompts[0]) + 2])  # row 0's third reply token becomes an end-of-turn token
    gen.eos = frozenset({stop})
    cut = gen.generate(prompts, max_new_tokens=8)
    for p, a, b in zip(prompts, full, cut):
        reply = a.ids[len(p):].tolist()
        end = reply.index(stop) + 1 if stop in reply else len(reply)
        assert b.ids[len(p):].tolist() == reply[:end]
        np.testing.assert_allclose(b.hidden.astype(np.float32), a.hidden[: len(b.ids)].astype(np.float32), atol=2e-2)
    assert len(cut[0].ids) <= len(prompts[0]) + 3 < len(full[0].ids)  # row 0 left the batch early


def test_a_cache_made_through_the_runtime_keeps_its_replies_for_a_rerun(setup, tmp_path):
    loaded, bundle = setup
    gen = RuntimeGenerator(bundle, threads=2)
    config = replace(SELF_DATA, engine=gen.description)
    cache = build_cache(loaded, tmp_path / "made", config, show_progress=False, generator=gen)
    assert cache.meta["engine"] == gen.description and cache.meta["positions_per_hour"] > 0
    assert cache.meta["reply_positions"] == int(cache.assistant.sum()) > 0
    replies = load_replies(tmp_path / "made" / "replies.npz")
    assert list(replies) == cache.meta["conversation_ids"]
    # a later run takes the reply ids from the file and derives the same data, without generating
    again = replace(config, replies_file=str(tmp_path / "made" / "replies.npz"))
    gen.generate = None  # any generation would fail
    rerun = build_cache(loaded, tmp_path / "rerun", again, show_progress=False, generator=gen)
    np.testing.assert_array_equal(rerun.tokens, cache.tokens)
    np.testing.assert_array_equal(rerun.assistant, cache.assistant)
    reply_rows = np.flatnonzero(np.append(cache.assistant[1:], 0) == 1)  # rows that predict a reply token
    np.testing.assert_array_equal(rerun.labels[reply_rows], cache.labels[reply_rows])
    np.testing.assert_allclose(rerun.hidden.astype(np.float32), cache.hidden.astype(np.float32), atol=2e-2)
    # ... and the torch path reads the same file (features by the torch model this time)
    torch_rerun = build_cache(loaded, tmp_path / "torch", replace(again, engine=""), show_progress=False)
    np.testing.assert_array_equal(torch_rerun.tokens, cache.tokens)


def test_bad_replies_files_and_mismatched_bundles_get_one_sentence(setup, tmp_path, tiny_bundle_factory,
                                                                    tiny_model_factory):
    loaded, _ = setup
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(TrainingError, match="is not a replies file"):
        load_replies(bad)
    partial = tmp_path / "partial.npz"
    save_replies(partial, ["nobody"], [np.array([1, 2, 3])])
    with pytest.raises(TrainingError, match="has no reply for conversation"):
        build_cache(loaded, tmp_path / "x", replace(SELF_DATA, replies_file=str(partial)), show_progress=False)
    with pytest.raises(TrainingError, match="use it with --replies self"):
        replace(SELF_DATA, replies="sharegpt", replies_file=str(partial))
    from specdeploy.exporter.export.base import export_base

    fused_only = tmp_path / "ort-only"
    export_base(str(tiny_model_factory("llama")), fused_only, max_context=128, target="ort", progress=lambda m: None)
    with pytest.raises(TrainingError, match="no standard-op base graph"):
        RuntimeGenerator(fused_only)
    other = RuntimeGenerator(tiny_bundle_factory("qwen2"), threads=2)
    with pytest.raises(TrainingError, match="another base model"):
        other.check_base(loaded.weight_sha)


def test_a_time_limited_build_keeps_its_shards_and_replies_and_resumes(setup, tmp_path, monkeypatch):
    loaded, bundle = setup
    gen = RuntimeGenerator(bundle, threads=2)
    config = replace(SELF_DATA, engine=gen.description)
    real = gen.generate
    made = []

    def stop_after_one(prompts, *a, **k):  # the first shard takes longer than the whole limit
        made.append(len(prompts))
        return real(prompts, *a, **k)

    gen.generate = stop_after_one
    assert build_cache(loaded, tmp_path / "c", config, show_progress=False, generator=gen, time_limit_s=0) is None
    assert made == [] and not (tmp_path / "c" / "shards" / "00000").exists()
    import specdeploy.exporter.train.data as td

    clock = iter([0.0, 0.0, 100.0, 100.0, 100.0])
    real_time = td.time.time
    td.time.time = lambda: next(clock, 100.0)
    try:
        assert build_cache(loaded, tmp_path / "c", config, show_progress=False, generator=gen, time_limit_s=50) is None
    finally:
        td.time.time = real_time
    assert made == [SELF_DATA.shard_size]  # one shard made, then the limit
    partial = load_replies(tmp_path / "c" / "replies.partial.npz")
    assert len(partial) == SELF_DATA.shard_size
    import shutil

    # --keep-partial: the finished shard becomes the cache, if it holds both train and held-out sequences
    shutil.copytree(tmp_path / "c", tmp_path / "all-train")
    monkeypatch.setattr(td, "is_heldout", lambda conv, fraction, seed: False)
    with pytest.raises(TrainingError, match="too few for a train/held-out split"):
        build_cache(loaded, tmp_path / "all-train", config, show_progress=False, generator=gen, time_limit_s=0,
                    keep_partial=True)
    shutil.copytree(tmp_path / "c", tmp_path / "kept")
    monkeypatch.setattr(td, "is_heldout", lambda conv, fraction, seed: conv.id == next(iter(partial)))
    kept = build_cache(loaded, tmp_path / "kept", config, show_progress=False, generator=gen, time_limit_s=0,
                       keep_partial=True)
    monkeypatch.undo()
    assert kept.num_sequences == SELF_DATA.shard_size < kept.meta["planned_sequences"] == SELF_DATA.max_seqs
    assert int(kept.heldout.sum()) == 1
    assert list(load_replies(tmp_path / "kept" / "replies.npz")) == list(partial)
    assert made == [SELF_DATA.shard_size]  # nothing more was generated for it
    cache = build_cache(loaded, tmp_path / "c", config, show_progress=False, generator=gen)
    assert made == [SELF_DATA.shard_size] * 2  # the rerun made only the missing shard
    full = load_replies(tmp_path / "c" / "replies.npz")
    assert list(full)[: len(partial)] == list(partial)
    for cid, ids in partial.items():
        np.testing.assert_array_equal(full[cid], ids)
    assert cache.num_sequences == SELF_DATA.max_seqs


def test_replies_files_are_small_and_keep_their_ids(tmp_path):
    path = tmp_path / "r.npz"
    save_replies(path, ["a", "b"], [np.array([1, 49151], np.int32), np.array([65535])])
    with np.load(path) as f:
        assert f["ids"].dtype == np.uint16
    got = load_replies(path)
    assert got["a"].tolist() == [1, 49151] and got["b"].tolist() == [65535] and got["a"].dtype == np.int32
    save_replies(path, ["c"], [np.array([70000])])  # a vocabulary past 16 bits keeps int32
    assert load_replies(path)["c"].tolist() == [70000]


def test_training_data_stops_before_the_held_in_prompts(setup, monkeypatch):
    import specdeploy.exporter.train.sharegpt as sg

    loaded, _ = setup
    monkeypatch.setattr(sg, "HELDIN_START", 3)
    with pytest.raises(TrainingError, match="where the held-in calibration prompts start; lower --max-seqs"):
        list(sg.select_sequences(loaded.tokenizer, SELF_DATA))


def test_train_data_command_makes_the_data_alone_and_resumes(setup, tmp_path, tiny_model_factory):
    from click.testing import CliRunner
    from specdeploy.exporter.cli import main

    _, bundle = setup
    args = ["train", "data", "--model", str(tiny_model_factory("llama")), "--engine", str(bundle), "--max-seqs", "32",
            "--max-len", "96", "--reply-tokens", "40", "--data", str(tmp_path / "d"), "--device", "cpu"]
    first = CliRunner().invoke(main, [*args, "--time-limit", "0"])
    assert first.exit_code == 0, first.output
    assert "time limit reached: 0 of 1 shards (0 reply positions)" in first.output
    assert "run the same command again to go on" in first.output
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    assert (tmp_path / "d" / "meta.json").is_file() and (tmp_path / "d" / "replies.npz").is_file()
    assert str(tmp_path / "d") in done.output and "reply positions per hour" in done.output


def test_the_runtime_engine_gives_the_tapped_layers_of_a_bundle_that_outputs_them(setup, tiny_model_factory,
                                                                                  tmp_path):
    from specdeploy.exporter.export.base import export_base

    loaded, plain_bundle = setup
    bundle = tmp_path / "taps"
    export_base(str(tiny_model_factory("llama")), bundle, max_context=512, max_tree=64, feature_layers="0",
                progress=lambda m: None)
    gen = RuntimeGenerator(bundle, threads=2)
    config = replace(SELF_DATA, engine=gen.description, feature_layers=(0,))
    cache = build_cache(loaded, tmp_path / "made", config, show_progress=False, generator=gen)
    # the torch model derives the same layer states from the same replies
    again = replace(config, engine="", replies_file=str(tmp_path / "made" / "replies.npz"))
    torch_cache = build_cache(loaded, tmp_path / "torch", again, show_progress=False)
    np.testing.assert_array_equal(torch_cache.tokens, cache.tokens)
    np.testing.assert_allclose(cache.layers.astype(np.float32), torch_cache.layers.astype(np.float32), atol=2e-2)
    # a bundle without them says so in one sentence; one with them also makes plain data
    plain = RuntimeGenerator(plain_bundle, threads=2)
    from specdeploy.exporter.train.data import training_cache

    with pytest.raises(TrainingError, match="outputs none; export it with the same --feature-layers"):
        training_cache(loaded, replace(SELF_DATA, feature_layers=(0,)), tmp_path / "x", engine=str(plain_bundle))
    assert plain.graph.feature_layers == ()
    no_taps = build_cache(loaded, tmp_path / "notaps", replace(SELF_DATA, engine=gen.description),
                          show_progress=False, generator=gen)
    assert no_taps.layers is None and not (tmp_path / "notaps" / "layers.npy").exists()


def test_the_torch_backend_generates_the_runtimes_data_with_its_taps(setup, tiny_model_factory, tmp_path):
    """The GPU's engine (exporter/train/ondevice.py): the torch backend, rebuilt from the bundle's weights with
    the graph's taps, through the same batched generator, gives the ONNX Runtime engine's replies, hidden states,
    tapped layers and labels."""
    from specdeploy.exporter.export.base import export_base
    from specdeploy.exporter.reference.torch_backend import TorchBackend
    from specdeploy.exporter.train.selfdistill import BatchGenerator
    from specdeploy.runtime.bundle import read_manifest

    bundle = tmp_path / "taps"
    export_base(str(tiny_model_factory("llama")), bundle, max_context=512, max_tree=64, feature_layers="0",
                progress=lambda m: None)
    ort = RuntimeGenerator(bundle, threads=2)
    manifest = read_manifest(bundle)
    with TorchBackend(bundle, manifest, device="cpu", cuda_graphs=False) as backend:
        assert backend.feature_layers == (0,)  # the bundle graph's taps, unasked
        gen = BatchGenerator(backend, manifest.model.eos_token_ids, "torch")
        with load(bundle, draft=None) as plain:
            prompts = _prompts(plain)
        got, want = gen.generate(prompts, max_new_tokens=10), ort.generate(prompts, max_new_tokens=10)
    for g, w in zip(got, want, strict=True):
        assert g.ids.tolist() == w.ids.tolist() and g.mask.tolist() == w.mask.tolist()
        assert g.labels.tolist() == w.labels.tolist()
        np.testing.assert_allclose(g.hidden.astype(np.float32), w.hidden.astype(np.float32), atol=2e-2)
        assert g.layers is not None and g.layers.shape == w.layers.shape
        np.testing.assert_allclose(g.layers.astype(np.float32), w.layers.astype(np.float32), atol=2e-2)


def test_feature_layers_options_are_checked_in_one_sentence(setup):
    from specdeploy.exporter.train.options import resolve_feature_layers

    cfg = setup[0].model.config  # 2 layers: only layer 0 can be tapped
    assert resolve_feature_layers("0", cfg) == (0,) and resolve_feature_layers("", cfg) == ()
    for bad, why in (("1", "must increase within 0..0"), ("x", "comma-separated layer numbers"),
                     ("eagle3", "at least 4 decoder layers")):
        with pytest.raises(TrainingError, match=why):
            resolve_feature_layers(bad, cfg)
