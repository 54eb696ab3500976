"""The n-gram drafter: the table's counts, its chains and their sizing, its bundle entry and its errors,
and speculative output identical to plain decoding."""

from __future__ import annotations

import shutil
import threading
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from specdeploy.exporter.cli import main
from specdeploy.exporter.export.ngram import build_table, calibrate, count_order, export_ngram, read_replies
from specdeploy.runtime import load
from specdeploy.runtime.bundle import read_manifest
from specdeploy.runtime.decode import DecodeStats, GenerationConfig
from specdeploy.runtime.drafters.base import DraftContext
from specdeploy.runtime.drafters.ngram import TABLE_FILE, NgramDrafter, NgramTable, pack
from specdeploy.runtime.errors import BundleError, DraftMismatchError

SHIPPED_REPLIES = Path(__file__).resolve().parents[2] / "graphs" / "weights" / "self-replies.npz"


def _random_replies(seed: int = 0, n: int = 40, vocab: int = 12) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, 30)).astype(np.int64) for _ in range(n)]


def _brute_force(replies: list[np.ndarray], order: int) -> dict[tuple[int, ...], tuple[int, int, int]]:
    """{context: (most frequent next token, smaller id on ties; its count; context count)} by counting."""
    follow: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for seq in replies:
        seq = seq.tolist()
        for i in range(order, len(seq)):
            follow[tuple(seq[i - order : i])][seq[i]] += 1
    out = {}
    for ctx, counts in follow.items():
        top = max(counts.values())
        out[ctx] = (min(t for t, c in counts.items() if c == top), top, sum(counts.values()))
    return out


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_counts_match_a_brute_force_count(order):
    replies = _random_replies()
    keys, nxt, top, total = count_order(replies, order)
    assert np.all(np.diff(keys.astype(np.float64)) > 0)  # sorted, one entry per context
    expected = _brute_force(replies, order)
    assert len(keys) == len(expected)
    for ctx, (tok, count, seen) in expected.items():
        at = int(np.searchsorted(keys, np.uint64(pack(ctx))))
        assert (int(nxt[at]), int(top[at]), int(total[at])) == (tok, count, seen)


def test_the_table_backs_off_to_shorter_contexts_and_round_trips(tmp_path):
    replies = [np.array([5, 6, 7, 8, 9]), np.array([1, 6, 7, 3]), np.array([2, 7, 4])]
    table = build_table(replies, vocab_size=16)
    assert table.predict([5, 6, 7, 8])[0] == 9  # order 4
    assert table.predict([0, 0, 6, 7])[0] == 3  # "6 7" -> 8 once, 3 once: the smaller id
    assert table.predict([0, 0, 0, 7])[0] == 3  # "7" -> 8, 3, 4 once each
    assert table.predict([11])[0] == -1  # never seen
    np.savez(tmp_path / "t.npz", **table.arrays())
    again = NgramTable.load(tmp_path / "t.npz")
    chain, chance = again.chain([0, 5, 6], 8)
    assert chain == table.chain([0, 5, 6], 8)[0] == [7, 8, 9]  # then nothing follows "9"
    assert len(chance) == 3 and all(0 < c < 1 for c in chance)


def test_a_vocabulary_over_16_bits_packs_wider_ids_and_fewer_orders(tmp_path):
    """Qwen's 151,936 ids take 18 bits each: three of them fit a key, and the table still round-trips."""
    from specdeploy.runtime.drafters.ngram import max_order, token_bits

    vocab = 151_936
    assert (token_bits(vocab), max_order(vocab)) == (18, 3) and (token_bits(49_152), max_order(49_152)) == (16, 4)
    big = [151_935, 70_000, 5, 131_072]
    replies = [np.array(big * 6 + [9, 70_000, 5, 42])]
    table = build_table(replies, vocab_size=vocab, max_order=max_order(vocab))
    np.savez(tmp_path / "t.npz", **table.arrays())
    again = NgramTable.load(tmp_path / "t.npz")
    assert again.bits == 18 and again.tokens[0].max() == 151_935
    assert again.predict([151_935, 70_000, 5]) == table.predict([151_935, 70_000, 5])
    assert again.predict([151_935, 70_000, 5])[0] == 131_072  # the 3-token context, not a collision of packed ids
    assert again.predict([9, 70_000, 5])[0] == 42


def test_the_chains_context_bound_drafts_what_an_unbounded_search_drafts():
    """The chain skips orders longer than the last known context plus one: never a different token."""
    replies = _random_replies(3, 60, 5)  # a small vocabulary: long contexts recur
    table = build_table(replies, vocab_size=8)
    rng = np.random.default_rng(4)
    for _ in range(200):
        context = rng.integers(0, 5, rng.integers(1, 7)).tolist()
        chain, _ = table.chain(context, 12, floor=0.0)
        ref, ctx = [], list(context)
        for _ in range(12):
            tok = table.predict(ctx)[0]  # every order tried, longest first
            if tok < 0:
                break
            ref.append(tok)
            ctx.append(tok)
        assert chain == ref


def test_calibration_measures_higher_hit_rates_where_the_evidence_is_stronger():
    replies = [np.array([1, 2, 3, 4, 5, 6] * 5 + [7])] * 40 + _random_replies(1, 200, 40)
    rate, stats = calibrate(replies, vocab_size=64)
    assert stats["heldout_positions"] > 0 and 0 < stats["heldout_top1"] < 1
    table = build_table(replies, 64, hit_rate=rate)
    _, repeated = table.chain([6, 1, 2, 3], 1)  # a context seen hundreds of times, always followed by 4
    _, random = table.chain([39, 38], 1)  # noise
    assert repeated[0] > 0.9 > random[0]


def _drafter(replies, curve) -> NgramDrafter:
    rate, _ = calibrate(replies * 16, vocab_size=64)
    drafter = NgramDrafter(build_table(replies * 16, 64, hit_rate=rate))
    drafter.use_cost_curve(curve)
    return drafter


def test_the_chain_length_follows_the_step_cost():
    replies = [np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 10])]
    ctx = DraftContext(np.array([9, 1, 2]), None, None, 64)
    cheap = _drafter(replies, {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.05, 16: 1.1}).propose(ctx)
    assert cheap.tokens.tolist() == [2, 3, 4, 5, 6, 7, 8, 10]  # a chain the table is sure of, all of it
    assert cheap.parents.tolist() == list(range(-1, 7))
    costly = _drafter(replies, {1: 1.0, 2: 5.0, 4: 10.0, 8: 20.0, 16: 40.0})
    assert costly.propose(ctx).num_nodes == 1  # no chain pays: a plain step
    assert costly.sources == {"lookup": 0, "table": 0, "plain": 1}


def test_the_table_learns_from_what_it_earns():
    replies = [np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 10])]
    drafter = _drafter(replies, {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.05, 16: 1.1})
    ctx = DraftContext(np.array([9, 1, 2]), None, None, 64)
    for _ in range(30):  # every chain rejected at once: the table's calibration no longer holds here
        tree = drafter.propose(ctx)
        drafter.accepted(np.array([0]), tree)
    assert drafter.propose(ctx).num_nodes < 8
    assert drafter._earned / drafter._predicted < 0.5


def _tiny_replies(bundle: Path, path: Path, prompts: list[str]) -> None:
    """The tiny model's own greedy replies, saved as the data engine saves them."""
    with load(bundle, draft=None) as engine:
        replies = [engine.generate_ids(engine.encode(p), GenerationConfig(40)) for p in prompts]
        sha = engine.manifest.source.weight_sha
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in replies])])
    np.savez(path, conversation_ids=np.array([str(i) for i in range(len(replies))]), offsets=offsets,
             ids=np.concatenate(replies).astype(np.uint16), base_weight_sha=np.array(sha))


PROMPTS = ["Hello there, how are you today?", "1 2 3 4 5", "The quick brown fox", "Write a poem about the sea.",
           "What is two plus two?", "Tell me a story"]


def test_ngram_speculation_is_identical_to_plain_decoding(tiny_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    _tiny_replies(bundle, tmp_path / "replies.npz", PROMPTS * 3)
    with pytest.raises(DraftMismatchError, match="has no n-gram table; add one with"):
        load(bundle, draft="ngram")
    entry = export_ngram(bundle, tmp_path / "replies.npz", progress=lambda m: None)
    assert entry.kind == "ngram" and entry.graphs == () and (bundle / TABLE_FILE).is_file()
    with load(bundle, draft=None) as plain, load(bundle, draft="ngram") as spec:
        assert spec.decoder.drafter.kind == "ngram"
        taus = []
        for text in [*PROMPTS, "A prompt the table has never seen", "1 2 3"]:
            ids = plain.encode(text)
            stats = DecodeStats()
            assert spec.generate_ids(ids, GenerationConfig(40), stats) == plain.generate_ids(ids, GenerationConfig(40))
            taus.append(stats.mean_accepted)
        sources = spec.decoder.drafter.sources
    assert sources["table"] > 0
    assert np.mean(taus[: len(PROMPTS)]) > 1.5  # the model's own replies, drafted from the table and accepted
    # Continuous batching: a lone sequence drafts from the table too (where the plan needs no padding rows:
    # test_batch.py forces both cases); batched answers equal lone ones.
    with load(bundle, draft="ngram", max_batch=3) as eng:
        alone = [eng.generate(p, max_new_tokens=40) for p in PROMPTS[:3]]
        if eng.scheduler.draft:
            assert max(a.stats.mean_accepted for a in alone) > 1.5
        else:
            assert "decodes plainly too" in eng.batch_reason
        out: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, eng.generate(PROMPTS[i], max_new_tokens=40)
                                                                        .token_ids)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert [out[i] for i in range(3)] == [a.token_ids for a in alone]


def test_bad_tables_and_replies_get_one_sentence(tiny_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    sha = read_manifest(bundle).source.weight_sha
    bad = tmp_path / "bad.npz"
    np.savez(bad, offsets=np.array([0, 2]), ids=np.array([1, 2]), base_weight_sha=np.array("0" * 64))
    with pytest.raises(DraftMismatchError, match="made by another model"):
        read_replies(bad, 49152, sha)
    np.savez(bad, offsets=np.array([0, 2]), ids=np.array([1, 70000]))
    with pytest.raises(DraftMismatchError, match="outside the bundle's vocabulary"):
        read_replies(bad, 49152, sha)
    np.savez(bad, offsets=np.array([0, 5]), ids=np.array([1, 2]))
    with pytest.raises(DraftMismatchError, match="offsets do not match"):
        read_replies(bad, 49152, sha)
    result = CliRunner().invoke(main, ["export", "draft", "--kind", "ngram", "--draft", str(tmp_path / "none.npz"),
                                       str(bundle)])
    assert result.exit_code != 0 and "Cannot read the replies file" in result.output
    assert "Traceback" not in result.output and not (bundle / TABLE_FILE).exists()  # nothing half-written
    np.savez(bad, offsets=np.array([0, 3]), ids=np.array([1, 2, 3]), base_weight_sha=np.array(sha))
    export_ngram(bundle, bad, progress=lambda m: None)
    with open(bundle / TABLE_FILE, "r+b") as fh:  # a damaged table
        fh.seek(100)
        fh.write(b"\x00\xff" * 8)
    with pytest.raises(BundleError, match="does not match the bundle's manifest"):
        load(bundle, draft="ngram")
    (bundle / TABLE_FILE).unlink()
    with pytest.raises(BundleError, match="missing"):
        load(bundle, draft="ngram")


def test_the_hybrid_weighs_the_tables_chain_against_the_model():
    from specdeploy.runtime.drafters.base import Drafter
    from specdeploy.runtime.drafters.hybrid import HybridDrafter
    from specdeploy.runtime.tree import DraftTree

    class Model(Drafter):
        kind = "stub"
        calls = 0

        def propose(self, ctx):
            self.calls += 1
            return DraftTree(np.array([ctx.tokens[-1], 42]), np.array([-1, 0]))

    lookup = _drafter([np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 10])], {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.05, 16: 1.1})
    model = Model()
    hybrid = HybridDrafter(model, lookup=lookup, chains=True)
    h = np.zeros((1, 4), np.float32)
    tree = hybrid.propose(DraftContext(np.array([9, 1, 2]), h, None, 64))
    assert tree.tokens.tolist() == [2, 3, 4, 5, 6, 7, 8, 10] and model.calls == 0  # the table's sure chain wins
    assert tree.value > 3.0  # priced: expected tokens per unit of cost (a plain step: 1.0)
    hybrid.accepted(np.arange(8), tree)
    assert hybrid.sources == {"lookup": 1, "model": 0, "plain": 0}
    assert hybrid.profile()["lookup_steps_by_source"] == {"lookup": 0, "table": 1, "plain": 0}
    tree = hybrid.propose(DraftContext(np.array([30, 31, 32]), h, None, 64))  # nothing known: the model drafts
    assert tree.tokens.tolist() == [32, 42] and model.calls == 1
