"""The shared draft training-data pipeline: ShareGPT streaming, chat formatting, the base-feature cache."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from specdeploy.exporter.train import data as td
from specdeploy.exporter.train.data import DataConfig, HiddenCache, build_cache
from specdeploy.exporter.train.sharegpt import (
    Conversation,
    conversation,
    encode_conversation,
    is_heldout,
    iter_conversations,
    iter_json_array,
)
from specdeploy.runtime.errors import TrainingError

TINY_DATA = DataConfig(max_seqs=10, max_len=64, min_assistant_tokens=8, heldout_fraction=0.3, shard_size=4)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_streaming_stops_cleanly_at_a_truncated_end(tmp_path, chunk):
    items = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "hi " * i}]} for i in range(5)]
    text = json.dumps(items, indent=2)
    cut = text.index('"c4"') + 10  # inside the last item, as in the shipped ShareGPT file
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    assert [x["id"] for x in iter_json_array(path, chunk)] == ["c0", "c1", "c2", "c3"]
    path.write_text(text)  # complete file: every item
    assert len(list(iter_json_array(path, chunk))) == 5
    path.write_text("[1, 2, 33")  # a bare number at the cut may be incomplete: dropped
    assert list(iter_json_array(path, chunk)) == [1, 2]


def test_streaming_rejects_a_non_array(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"a": 1}')
    with pytest.raises(TrainingError, match="not a JSON array"):
        list(iter_json_array(path))


def test_real_sharegpt_first_items():
    convs = []
    for c in iter_conversations():
        convs.append(c)
        if len(convs) == 3:
            break
    assert convs[0].id == "QWJhYvA_0"
    for c in convs:
        roles = [r for r, _ in c.messages]
        assert roles[0] == "user" and all(a != b for a, b in itertools.pairwise(roles))
        assert set(roles) == {"user", "assistant"}


def test_roles_mapping_and_malformed_items():
    item = {"id": "x_1", "conversations": [
        {"from": "gpt", "value": "a continuation, dropped"},
        {"from": "human", "value": "question"},
        {"from": "gpt", "value": "answer"},
        {"from": "gpt", "value": "second reply in a row: ends the conversation"},
    ]}
    conv = conversation(item)
    assert conv.messages == (("user", "question"), ("assistant", "answer"))
    assert conv.root_id == "x"
    assert conversation({"id": "y", "conversations": [{"from": "human", "value": "alone"}]}) is None
    assert conversation("not a dict") is None


def test_assistant_mask_covers_the_replies(smol_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_tokenizer_dir)
    conv = Conversation("t_0", (("user", "Name a color."), ("assistant", "Blue."), ("user", "Another?"),
                                ("assistant", "Red, of course.")))
    ids, mask = encode_conversation(tok, conv, 512)
    text = tok.apply_chat_template(conv.as_messages(), tokenize=False)
    assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    replies = tok.decode(ids[mask == 1])
    assert "Blue." in replies and "Red, of course." in replies
    assert "Name a color" not in replies and "Another?" not in replies
    short, short_mask = encode_conversation(tok, conv, 10)
    assert short.size == 10 and short_mask.size == 10


@pytest.fixture(scope="module")
def tiny_cache(tiny_model_factory, tmp_path_factory):
    from specdeploy.exporter.source import load_model

    loaded = load_model(str(tiny_model_factory("llama")))
    cache = build_cache(loaded, tmp_path_factory.mktemp("cache") / "data", TINY_DATA, show_progress=False)
    return loaded, cache


def test_cache_round_trip_matches_the_base_model(tiny_cache):
    import torch

    loaded, cache = tiny_cache
    assert cache.num_sequences == TINY_DATA.max_seqs
    assert cache.heldout.any() and not cache.heldout.all()
    assert cache.hidden.dtype == np.float16 and cache.hidden.shape == (cache.num_tokens, 64)
    again = HiddenCache.open(cache.path)
    s = 3
    a, b = int(again.offsets[s]), int(again.offsets[s + 1])
    ids = torch.from_numpy(np.asarray(again.tokens[a:b], dtype=np.int64))[None]
    with torch.no_grad():
        h = loaded.model.model(input_ids=ids).last_hidden_state[0]
        labels = loaded.model.lm_head(h).argmax(-1)
    np.testing.assert_allclose(np.asarray(again.hidden[a:b], np.float32), h.numpy(), atol=2e-2, rtol=1e-2)
    assert np.array_equal(np.asarray(again.labels[a:b]), labels.numpy())
    assert again.meta["conversation_ids"] == cache.meta["conversation_ids"]
    # a finished cache is reused, not rebuilt
    assert build_cache(loaded, cache.path, TINY_DATA, show_progress=False).meta == cache.meta


def test_cache_rejects_another_base_and_corruption(tiny_cache, tmp_path):
    import shutil

    _loaded, cache = tiny_cache
    with pytest.raises(TrainingError, match="another base model"):
        cache.check_base("0" * 64, 64, 49152)
    broken = tmp_path / "broken"
    shutil.copytree(cache.path, broken)
    (broken / "labels.npy").write_bytes(b"garbage")
    with pytest.raises(TrainingError, match="corrupt"):
        HiddenCache.open(broken)
    with pytest.raises(TrainingError, match="no meta.json"):
        HiddenCache.open(tmp_path)


def test_head_targets_and_positions(tiny_cache):
    _, cache = tiny_cache
    pos = cache.positions("train")
    assert pos.size > 0 and np.all(cache.assistant[pos + 1] == 1)
    assert not np.isin(pos, cache.positions("heldout")).any()
    labels, valid = cache.head_targets(pos, 4)
    ends = cache.seq_end()[pos]
    for k in range(4):
        ok = pos + 1 + k < ends
        assert np.array_equal(valid[:, k], ok)
        assert np.array_equal(labels[ok, k], cache.labels[pos[ok] + 1 + k])


def test_interrupted_cache_build_resumes_from_its_shards(tiny_model_factory, tmp_path, monkeypatch):
    from specdeploy.exporter.source import load_model

    loaded = load_model(str(tiny_model_factory("llama")))
    calls = []
    real = td.forward_shard

    def flaky(model, seqs, *rest):
        calls.append(len(seqs))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(model, seqs, *rest)

    monkeypatch.setattr(td, "forward_shard", flaky)
    with pytest.raises(KeyboardInterrupt):
        build_cache(loaded, tmp_path / "c", TINY_DATA, show_progress=False)
    assert len(list((tmp_path / "c" / "shards").glob("0*"))) == 1
    calls.clear()
    monkeypatch.setattr(td, "forward_shard", real)
    cache = build_cache(loaded, tmp_path / "c", TINY_DATA, show_progress=False)
    assert cache.num_sequences == TINY_DATA.max_seqs
    assert not (tmp_path / "c" / "shards").exists()


def test_heldout_split_is_per_conversation():
    a, b = Conversation("abc_0", (("user", "q"), ("assistant", "a"))), Conversation("abc_7", (("user", "q"),
                                                                                           ("assistant", "a")))
    for seed in range(20):
        assert is_heldout(a, 0.5, seed) == is_heldout(b, 0.5, seed)


def test_self_generated_replies_are_the_base_models_own_greedy_text(tiny_model_factory, tmp_path):
    import torch
    from specdeploy.exporter.source import load_model

    loaded = load_model(str(tiny_model_factory("llama")))
    tok, model = loaded.tokenizer, loaded.model
    cfg = DataConfig(max_seqs=6, max_len=96, min_assistant_tokens=4, heldout_fraction=0.4, shard_size=3,
                     replies="self", reply_tokens=12)
    assert cfg.key() != DataConfig(max_seqs=6, max_len=96, min_assistant_tokens=4, heldout_fraction=0.4).key()
    prompts = [ids for _, ids, _ in itertools.islice(td.select_sequences(tok, cfg), 3)]
    assert all(len(p) + 12 <= 96 for p in prompts)
    # batched (left-padded) generation gives each prompt the same reply as generating it alone
    batched = td.generate_replies(model, tok, prompts, 12)
    for p, (ids, mask) in zip(prompts, batched, strict=True):
        with torch.no_grad():
            alone = model.generate(torch.from_numpy(p.astype(np.int64))[None], max_new_tokens=12, do_sample=False,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(p):]
        assert np.array_equal(ids[: len(p)], p) and not mask[: len(p)].any()
        assert np.array_equal(ids[len(p):], alone.numpy()[: len(ids) - len(p)]) and mask[len(p):].all()
    cache = build_cache(loaded, tmp_path / "self", cfg, show_progress=False)
    assert cache.num_sequences == 6 and cache.meta["config"]["replies"] == "self"
    # labels inside the replies are the fp32 base's next token: the replies are (up to bf16 rounding) its own
    pos = cache.positions("train")
    agree = np.mean(np.asarray(cache.labels[pos]) == np.asarray(cache.tokens[pos + 1]))
    assert pos.size > 20 and agree > 0.7, agree


def test_data_config_rejects_unknown_reply_sources():
    with pytest.raises(TrainingError, match="reply source"):
        DataConfig(replies="web")
    with pytest.raises(TrainingError, match="reply_tokens"):
        DataConfig(replies="self", reply_tokens=600, max_len=512)
    # the ShareGPT-reply cache keeps the key it had before self-generated replies existed
    import dataclasses
    import hashlib

    d = dataclasses.asdict(DataConfig())
    for k in ("shard_size", "replies", "reply_tokens", "engine", "replies_file", "feature_layers"):
        d.pop(k)
    assert DataConfig().key() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def test_the_cli_builds_one_train_run_for_the_kinds_trainer(monkeypatch, tmp_path):
    """`train chimera|medusa|cerberus`: every option lands in the ``TrainRun`` the kind's trainer gets, over
    that kind's defaults (``HEADS_DEFAULTS`` / ``CHIMERA_DEFAULTS``, the only place they are written)."""
    from click.testing import CliRunner
    from specdeploy.exporter.cli import main
    from specdeploy.exporter.train.options import CHIMERA_DEFAULTS, HEADS_DEFAULTS
    from specdeploy.runtime.drafters import kinds

    got = {}

    def trainer(kind, run, resume="auto", show_progress=True, log=None):
        got[kind] = (run, resume)

    monkeypatch.setattr(kinds, "resolve", lambda name: trainer)
    r = CliRunner().invoke(main, ["train", "cerberus", "--out", str(tmp_path / "c.safetensors"), "--epochs", "5",
                                  "--time-limit", "2.5", "--no-calibrate", "--layers", "2"])
    assert r.exit_code == 0, r.output
    run, resume = got["cerberus"]
    assert (run.epochs, run.time_limit, run.layers, resume) == (5, 2.5, 2, "auto")
    assert (run.batch_size, run.max_seqs, run.replies) == (HEADS_DEFAULTS.batch_size, HEADS_DEFAULTS.max_seqs,
                                                           HEADS_DEFAULTS.replies)
    r = CliRunner().invoke(main, ["train", "chimera", "--out", str(tmp_path / "x.safetensors"), "--restart",
                                  "--feature-layers", "eagle3", "--max-seqs", "64"])
    assert r.exit_code == 0, r.output
    run, resume = got["chimera"]
    assert (run.max_seqs, run.feature_layers, resume) == (64, "eagle3", "restart")
    assert (run.epochs, run.vocab_trim, run.batch_size) == (CHIMERA_DEFAULTS.epochs, CHIMERA_DEFAULTS.vocab_trim,
                                                            CHIMERA_DEFAULTS.batch_size)
    assert run.loop("cpu").time_limit_s is None and run.data().max_seqs == 64


def test_a_batch_without_a_target_position_is_skipped_not_fatal(tiny_setup, tmp_path):
    """A batch whose every label falls outside the draft vocabulary has a constant loss (no gradient): the loop
    skips its update and goes on (it once ended a Qwen Chimera run at step 268 with a RuntimeError)."""
    import torch
    from specdeploy.exporter.train.weights import load_draft_weights, train
    from tiny_training import HEADS_LOOP, heads_task

    task = heads_task(tiny_setup, "medusa", vocab_trim=1024)
    real, calls = task.loss, []

    def loss(model, index):
        calls.append(len(index))
        if len(calls) == 2:  # the second batch: nothing to learn from
            return torch.zeros(()), {}
        return real(model, index)

    task.loss = loss
    result = train(task, tmp_path / "m.safetensors", HEADS_LOOP, show_progress=False, log=lambda m: None)
    assert len(calls) == result.steps > 2
    assert load_draft_weights(tmp_path / "m.safetensors").meta["train"]["steps"] == result.steps
