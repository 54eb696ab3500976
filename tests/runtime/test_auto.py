"""``--draft auto`` (``runtime/drafters/auto.py``): the per-step choice between the free sources, a trained
draft and a plain step; greedy identity with plain decoding; sampling stays exact (chi-square, N = 5000)."""

from __future__ import annotations

import numpy as np
import pytest
from decode_checks import concurrently
from decode_checks import draft_context as _ctx
from decode_checks import free_sources as _free
from scipy.stats import chisquare
from specdeploy.runtime import load
from specdeploy.runtime.decode import Decoder, DecodeStats, GenerationConfig, SamplingParams
from specdeploy.runtime.drafters import make_drafter
from specdeploy.runtime.drafters.auto import RETRY_EVERY, AutoDrafter, FreeSources
from specdeploy.runtime.drafters.base import DraftContext, Drafter
from specdeploy.runtime.drafters.hybrid import PaidDraft
from specdeploy.runtime.drafters.prompt_lookup import PromptLookupDrafter
from specdeploy.runtime.drafters.suffix import SuffixCache, SuffixDrafter
from specdeploy.runtime.tree import DraftTree
from specdeploy.runtime.verify import warp_logits

FLAT = {1: 1.0, 16: 1.05}  # a GPU-like cost curve: drafting is nearly free


class CountingModel(Drafter):
    """A trained draft stand-in: always proposes two tokens, and counts its calls."""

    kind = "chimera"

    def __init__(self):
        self.calls = 0

    def propose(self, ctx):
        self.calls += 1
        return DraftTree.chain([int(ctx.tokens[-1]), 1, 2])


def test_each_source_of_a_batched_sequence_is_weighed_by_what_it_earned(tiny_bundle, monkeypatch):
    """A batch's rows rule weighs a draft by its source's earned acceptance (an answer the suffix cache met before is
    near-certain, an n-gram's guess is not), and the decode loop keeps each source's apart."""
    from specdeploy.runtime.decode import Generation

    free = FreeSources(PromptLookupDrafter(cost_curve=FLAT), SuffixDrafter(SuffixCache(), cost_curve=FLAT, local=False))
    answer = list(range(100, 140))
    free.finished([1, 2, *answer], 2)
    assert free.propose(_ctx([5, *answer[:10]])).num_nodes > 1 and free.source == "suffix"
    assert free.propose(_ctx([7, 8, 9, 7, 8])).num_nodes > 1 and free.source == "lookup"
    auto = AutoDrafter(CountingModel(), _free(FLAT), chains=True)
    auto.propose(_ctx([100, 200]))  # nothing matches: the model drafts
    assert auto.source == "model"
    gen = Generation([1, 2, 3], GenerationConfig(), DecodeStats(), free)
    for source, accepted in (("suffix", 8), ("lookup", 0)):
        gen.source = source
        for _ in range(10):
            gen.acceptance.update(accepted, 8)
    gen.source = "suffix"
    assert gen.expected(8) > 7
    gen.source = "lookup"
    assert gen.expected(8) < 1.5

    steps = []  # (the source the loop credited, the drafter's own word) for each drafted step of a batch
    advance = Decoder._advance

    def spy(self, r, gen, *args):
        if gen.tree.num_nodes > 1 and gen.whole:
            steps.append((gen.source, gen.proposer.source))  # its drafter, or its recall where the gate ran plain
        return advance(self, r, gen, *args)

    monkeypatch.setattr(Decoder, "_advance", spy)
    with load(tiny_bundle, draft="auto", max_batch=4) as eng:
        if eng.max_batch == 1:
            pytest.skip(f"no batching on this machine: {eng.batch_reason}")
        concurrently(eng, ["one two three four one two three four one two"] * 3 + ["a b c a b c a b"], max_new_tokens=24)
    assert steps and all(credited == said and said in ("lookup", "suffix", "model") for credited, said in steps)


def test_the_model_runs_only_where_it_pays_and_is_retried_now_and_then():
    model = CountingModel()
    auto = AutoDrafter(model, _free(FLAT), chains=True)
    auto.model_acceptance.first = [1.0, 1000.0]  # the model has stopped paying
    for i in range(RETRY_EVERY):
        assert auto.propose(_ctx([100 + i, 200 + i])).num_nodes == 1  # no match anywhere: plain steps
        auto.accepted(np.array([0]), DraftTree.root(0))
    assert model.calls == 0
    tree = auto.propose(_ctx([7, 8]))  # a run of plain steps: the model gets one more try
    assert model.calls == 1 and tree.tokens.tolist() == [8, 1, 2]
    auto.model_acceptance.first = [1000.0, 1.0]  # now it pays: it drafts where nothing free matches
    auto.propose(_ctx([17, 18]))
    assert model.calls == 2


class GatedModel(CountingModel):
    """A stand-in with a gate of its own (as Cerberus has), which counts how often it is asked."""

    kind = "cerberus"

    def __init__(self, says: bool):
        super().__init__()
        self.says, self.asked = says, 0

    def wants_draft(self, ctx):
        self.asked += 1
        return self.says


@pytest.mark.parametrize("curve,pays", [(FLAT, True), ({1: 1.0, 2: 3.0, 16: 40.0}, False)])
def test_an_explicit_trained_draft_drafts_only_where_it_beats_a_plain_step(curve, pays):
    """``--draft chimera`` and the like: the hybrid's rule with no free source. A draft whose expected tokens
    per unit of cost (its own call included) are below a plain step's does not run; it is retried now and then."""
    model = CountingModel()
    alone = PaidDraft(model, chains=True)
    alone.use_cost_curve(curve)
    assert alone.kind == "chimera" and alone.needs_cost_curve
    for i in range(RETRY_EVERY + 1):
        tree = alone.propose(_ctx([100 + i, 200 + i]))
        alone.accepted(np.array([0, 1, 2][: tree.num_nodes]), tree)  # whatever it drafts is accepted
    if pays:
        assert model.calls == RETRY_EVERY + 1 and alone.sources == {"model": RETRY_EVERY + 1, "plain": 0}
    else:  # 3 expected tokens at best, for 3 plain steps' cost: never worth it, tried once after RETRY_EVERY
        assert model.calls == 1 and alone.sources["plain"] == RETRY_EVERY


def test_a_drafts_own_gate_is_asked_only_on_steps_the_rule_gives_it():
    for says in (True, False):
        model = GatedModel(says)
        alone = PaidDraft(model, chains=True)
        alone.use_cost_curve(FLAT)
        assert alone.propose(_ctx([1, 2])).num_nodes == (3 if says else 1)
        assert model.asked == 1 and model.calls == int(says)
    model = GatedModel(True)
    dear = PaidDraft(model, chains=True)
    dear.use_cost_curve({1: 1.0, 2: 3.0, 16: 40.0})  # the rule declines: the gate is not asked
    assert dear.propose(_ctx([1, 2])).num_nodes == 1 and model.asked == 0


def test_make_drafter_builds_auto_from_what_the_bundle_has(tiny_bundle):
    from specdeploy.runtime.bundle import read_manifest

    drafter = make_drafter("auto", tiny_bundle, read_manifest(tiny_bundle), suffix_cache_tokens=100)
    assert isinstance(drafter, FreeSources) and drafter.cache.max_tokens == 100  # no trained draft here


PROMPTS = ["one two three four one two three four one two", "def add(a, b):\n    return a + b\n\ndef add(a, b):",
           "one two three four one two three four one two"]


def test_auto_equals_plain_decoding_on_the_tiny_model(tiny_bundle):
    with load(tiny_bundle, draft=None) as plain, load(tiny_bundle, draft="auto") as spec:
        for text in PROMPTS:
            ids = plain.encode(text)
            stats = DecodeStats()
            assert spec.generate_ids(ids, GenerationConfig(32), stats) == plain.generate_ids(ids, GenerationConfig(32))
        if spec.plan.speculate:
            assert spec.decoder.drafter.cache.tokens > 0 and stats.steps < 31


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "seeded"])
def test_auto_sampling_is_exact(tiny_bundle, seeded):
    """The token after a repeated context, sampled through auto's draft and tree verification 5,000 times,
    against the warped base distribution: chi-square. Seeded: 5,000 seeds, each token drawn with its
    position's own stream (verify.seeded_accept)."""
    with load(tiny_bundle, draft=None) as engine:
        ids = engine.encode("one two three four one two three four one two three")
        sampling = SamplingParams(temperature=1.5, top_k=8)
        drafter = FreeSources(PromptLookupDrafter(cost_curve=FLAT), SuffixDrafter(SuffixCache(), cost_curve=FLAT))
        dec = Decoder(engine.backend, engine.manifest, drafter, plan=engine.plan)
        state, _ = dec.prefill(ids[:-1])
        state.tokens.append(ids[-1])  # the root repeats an earlier token: both free sources match
        root = DraftTree.root(ids[-1])
        p = warp_logits(dec.verify(state, root, root.buffers()).logits[0, 0], 1.5, 8, 1.0)
        support = np.flatnonzero(p)
        n, counts, rng = 5000, np.zeros(len(p)), np.random.default_rng(0)
        tree = None
        for i in range(n):
            drafter.reset()
            st, _ = dec.prefill(ids[:-1])
            st.tokens.append(ids[-1])
            tree = dec.propose(st, 8)
            bufs = tree.buffers()
            if seeded:
                sampling = SamplingParams(temperature=1.5, top_k=8, seed=i)
            acc = dec.accept(tree, bufs, dec.verify(st, tree, bufs), sampling, rng, len(st.tokens))
            counts[acc.tokens[0]] += 1
        assert tree.num_nodes > 1  # it drafted, so the draft's rows were verified
        assert counts[np.setdiff1d(np.arange(len(p)), support)].sum() == 0
        stat = chisquare(counts[support], p[support] * n)
        assert stat.pvalue > 1e-3, (stat, counts[support], p[support] * n)


def test_seeded_sampling_equals_plain_seeded_sampling_whatever_drafted(tiny_bundle):
    """A seeded request gives plain seeded sampling's tokens, one for one, with auto drafting and its
    cross-request state (suffix cache, estimates) changing between requests; batched rows draw alike."""
    prompt = "one two three four one two three four one two three four one"
    with load(tiny_bundle, draft=None) as plain, load(tiny_bundle) as spec, load(tiny_bundle, max_batch=2) as batched:
        drafted = 0
        for seed in (1, 2, 3):
            kw = {"prompt": prompt, "max_new_tokens": 40, "temperature": 0.8, "top_p": 0.95, "seed": seed}
            want = plain.generate(**kw).text
            first, second = spec.generate(**kw), spec.generate(**kw)
            assert first.text == want and second.text == want
            drafted += first.stats.gate_parallel + second.stats.gate_parallel
            assert batched.generate(**kw).text == want
        if spec.plan.speculate:  # it drafted (the tiny random model rarely confirms a draft when sampling)
            assert drafted > 0


class RecordingModel(CountingModel):
    """A stand-in with a cache of its own (as Chimera has): what each call took in, by position."""

    def __init__(self):
        super().__init__()
        self.took: list[tuple[list[int], list[int]]] = []  # per call: the positions of its hidden and layer rows

    def propose(self, ctx):
        self.took.append((ctx.hidden[:, 0].astype(int).tolist(), ctx.layers[:, 0].astype(int).tolist()))
        return super().propose(ctx)


def _states(positions) -> tuple[np.ndarray, np.ndarray]:
    """Hidden and layer states whose rows say which position they are (hidden [A, 4], layers [A, 12])."""
    pos = np.asarray(positions, dtype=np.float32)[:, None]
    return np.repeat(pos, 4, axis=1), np.repeat(pos, 12, axis=1)


def test_a_trained_draft_takes_in_nothing_until_the_rule_first_wants_it_and_then_catches_up_once():
    """Steps the model sits out hand it nothing; the first step the rule wants it, it takes in every token's states
    since the prompt's start (the prompt's included) in one call; after that, each call only what is new."""
    model = RecordingModel()
    auto = AutoDrafter(model, _free(FLAT), chains=True)
    auto.model_acceptance.first = [1.0, 1000.0]  # it does not pay
    prompt = list(range(100, 110))
    tokens = [*prompt, 500]  # the prefill's token is the first root
    hidden, layers = _states(range(len(prompt)))  # prefill: the prompt's states
    for _ in range(20):  # no match anywhere: plain steps, one token each
        ctx = DraftContext(np.asarray(tokens, dtype=np.int64), hidden, None, 17, layers)
        tree = auto.propose(ctx)
        assert tree.num_nodes == 1
        auto.accepted(np.array([0]), tree)
        hidden, layers = _states([len(tokens) - 1])  # the root's state; the bonus token becomes the next root
        tokens.append(1000 + len(tokens))
    assert model.calls == 0
    auto.model_acceptance.first = [1000.0, 1.0]  # now it pays
    tree = auto.propose(DraftContext(np.asarray(tokens, dtype=np.int64), hidden, None, 17, layers))
    everything = list(range(len(tokens) - 1))  # every token before the root, from the prompt's first
    assert model.calls == 1 and model.took == [(everything, everything)]
    auto.accepted(np.array([0, 1, 2]), tree)  # both drafted tokens accepted
    hidden, layers = _states([len(tokens) - 1, len(tokens), len(tokens) + 1])
    tokens += [1, 2, 7]
    auto.propose(DraftContext(np.asarray(tokens, dtype=np.int64), hidden, None, 17, layers))
    new = [len(tokens) - 4, len(tokens) - 3, len(tokens) - 2]
    assert model.calls == 2 and model.took[1] == (new, new)


def test_a_catch_up_takes_in_only_the_latest_states(monkeypatch):
    """However long the model sat out (the prompt included), its catch-up call takes in the latest ``catch_up``
    states only: a long context costs the draft a bounded call, not one row per token."""
    monkeypatch.setattr(AutoDrafter, "catch_up", 8)
    model = RecordingModel()
    auto = AutoDrafter(model, _free(FLAT), chains=True)
    auto.model_acceptance.first = [1.0, 1000.0]  # it does not pay
    tokens = [*range(100, 130), 500]
    hidden, layers = _states(range(30))  # the prompt's states
    for _ in range(5):  # plain steps: the model takes in nothing
        auto.accepted(np.array([0]), auto.propose(DraftContext(np.asarray(tokens, dtype=np.int64), hidden, None, 17,
                                                               layers)))
        hidden, layers = _states([len(tokens) - 1])
        tokens.append(1000 + len(tokens))
    auto.model_acceptance.first = [1000.0, 1.0]  # now it pays
    auto.propose(DraftContext(np.asarray(tokens, dtype=np.int64), hidden, None, 17, layers))
    latest = list(range(len(tokens) - 9, len(tokens) - 1))  # the 8 tokens before the root
    assert model.calls == 1 and model.took == [(latest, latest)]


def _catch_up_history(monkeypatch, drafted: int, sat_out: int) -> tuple[AutoDrafter, CountingModel, bool]:
    """A model tried once after a 40-token prompt (it catches up on 40 states: 5 ms a state beyond its 1 ms call;
    a step takes 10 ms), drafting ``drafted`` steps in a row, sitting ``sat_out`` plain steps out (one state each),
    then paying again: whether the rule calls it on the next step."""
    from specdeploy.runtime.drafters import hybrid

    now = [0.0]
    monkeypatch.setattr(hybrid.time, "perf_counter", lambda: now[0])

    class Slow(CountingModel):
        def propose(self, ctx):
            now[0] += 0.001 + (0.005 * len(ctx.hidden) if len(ctx.hidden) > hybrid.TYPICAL_ROWS else 0.0)
            return super().propose(ctx)

    model = Slow()
    auto = AutoDrafter(model, _free(FLAT), chains=True)
    tokens, (hidden, layers) = [*range(100, 140), 500], _states(range(40))
    pays, sits = [1000.0, 1.0], [1.0, 1000.0]
    for step in range(drafted + sat_out + 1):
        auto.model_acceptance.first = list(pays if step < drafted or step == drafted + sat_out else sits)
        before = model.calls
        tree = auto.propose(DraftContext(np.asarray(tokens, dtype=np.int64), hidden, None, 17, layers))
        called = model.calls > before
        now[0] += 0.010  # the verification step
        auto.accepted(np.arange(tree.num_nodes), tree)  # whatever it drafted lands
        hidden, layers = _states(range(len(tokens) - 1, len(tokens) - 1 + tree.num_nodes))
        tokens += [*tree.tokens[1:].tolist(), 2000 + len(tokens)]  # a fresh root: nothing for lookup to match
    return auto, model, called


def test_a_catch_up_is_priced_before_it_is_made_and_shared_among_the_calls_it_serves(monkeypatch):
    """A model call over many states costs its measured time per state beyond a typical call. A model that drafted
    a step and sat out again is then not tried where a long catch-up is due, though it pays on an ordinary step and
    is called where only a few states are new; one whose catch-ups each served many calls pays one once, and is
    called. The first catch-up, before any is timed, is made."""
    auto, model, called = _catch_up_history(monkeypatch, drafted=1, sat_out=5)
    assert called and model.calls == 2 and auto.catch_ups == 1  # 5 new states: a typical call
    row = 0.201 / 40  # the first catch-up came before any typical call was timed: all of its time
    assert auto.timer.row_s == pytest.approx(row) and auto.timer.catch_up_cost(20) == pytest.approx(20 * row / 0.010)
    assert auto.timer.catch_up_cost(8) == 0.0
    auto, model, called = _catch_up_history(monkeypatch, drafted=1, sat_out=20)
    assert not called and model.calls == 1  # 20 new states: about 10 steps' worth, shared by (1 + 4) / 2 calls
    assert auto._model_value(2) > 1.0 > auto._model_value(20)
    auto, model, called = _catch_up_history(monkeypatch, drafted=60, sat_out=20)
    assert called and model.calls == 61 and auto.catch_ups == 2  # the same, shared by (61 + 4) / 2 calls
    assert auto.profile()["model_catch_ups"] == 2 and auto.profile()["model_calls"] == 61


def test_a_call_in_a_step_others_share_is_priced_against_this_sequences_share():
    """A model call delays every sequence of a batch's step. One that pays alone (a tenth of a step, a first token
    nearly always accepted) does not in a step of 32, nor is it made in a shared step before it has been timed."""
    model = CountingModel()
    auto = AutoDrafter(model, _free(FLAT), chains=True)
    auto.model_acceptance.first = [1000.0, 1.0]

    def ctx(sequences: int) -> DraftContext:
        return DraftContext(np.asarray([100, 200], dtype=np.int64), np.zeros((1, 4), np.float32), None, 17,
                            sequences=sequences)

    assert auto.propose(ctx(2)).num_nodes == 1 and model.calls == 0  # untimed: unknown, and every sequence pays
    auto.timer.call_s, auto.timer.step_s = 0.001, 0.010
    assert auto._model_value(1) > auto._model_value(1, 4) > 1.0 > auto._model_value(1, 32)
    assert auto.propose(ctx(32)).num_nodes == 1 and model.calls == 0
    assert auto.propose(ctx(1)).num_nodes > 1 and model.calls == 1


def test_lookup_learns_only_from_its_own_nodes_of_a_merged_tree():
    """With trees, the model's nodes go under lookup's match; lookup is told the accepted path's nodes that were
    its own (a prefix: the model's nodes come after lookup's), all of them where the model did not run."""
    told = []
    auto = AutoDrafter(CountingModel(), _free(FLAT), chains=False)
    accepted = auto.lookup.accepted
    auto.lookup.accepted = lambda nodes, tree: told.append(nodes.tolist()) or accepted(nodes, tree)
    ctx = _ctx([5, 6, 7, 9, 5, 6])  # lookup: 6 -> 7 9 5 6
    auto.always_model = True  # the model drafts 6 -> 1 2 beside it
    tree = auto.propose(ctx)
    own = tree.num_nodes - 2  # the model's two nodes come last
    assert tree.tokens[own:].tolist() == [1, 2] and tree.parents[own:].tolist() == [0, own]
    auto.accepted(np.array([0, own, own + 1]), tree)  # the model's branch was right
    auto.accepted(np.array([0, 1, 2]), tree)  # lookup's was
    auto.always_model = False
    auto.model_acceptance.first = [1.0, 1000.0]
    alone = auto.propose(ctx)  # lookup's proposal alone
    auto.accepted(np.array([0, 1]), alone)
    assert told == [[0], [0, 1, 2], [0, 1]]


def test_the_model_learns_from_a_merged_tree_what_its_own_chain_would_have_earned():
    """Merged under lookup's match, the model's chain is judged by the accepted path: its tokens count as far as
    the path agrees with them, so a model whose merged nodes are never taken loses its estimate and stops."""
    auto = AutoDrafter(CountingModel(), _free(FLAT), chains=False)
    ctx = _ctx([5, 6, 7, 9, 5, 6])  # lookup: 6 -> 7 9 5 6; the model: 6 -> 1 2
    auto.always_model = True
    tree = auto.propose(ctx)
    own = tree.num_nodes - 2
    before = [list(auto.model_acceptance.first), list(auto.model_acceptance.later)]
    auto.accepted(np.array([0, own, own + 1]), tree)  # the model's branch was right, both tokens
    assert auto.model_acceptance.first == [before[0][0] + 1, before[0][1]]
    assert auto.model_acceptance.later == [before[1][0] + 1, before[1][1]]
    auto.accepted(np.array([0, 1, 2]), auto.propose(ctx))  # lookup's was: the model's first token was wrong
    assert auto.model_acceptance.first == [before[0][0] + 1, before[0][1] + 1]
    auto.always_model = False
    auto.model_acceptance.first, auto.model_acceptance.later = [20.0, 1.0], [20.0, 1.0]  # earned well: merged at first
    auto.model.calls = 0
    calls = []
    for _ in range(40):  # the merged model nodes are never taken; lookup's whole match is
        auto.accepted(np.arange(5), auto.propose(ctx))
        calls.append(auto.model.calls)
    assert calls[0] == 1 and calls[-1] == calls[-30]  # then no longer called


def test_what_the_model_earned_outlives_a_generation():
    auto = AutoDrafter(CountingModel(), _free(FLAT), chains=True)
    auto.model_acceptance.first = [1.0, 1000.0]
    auto.reset()  # a new request: the model is still known not to pay
    assert auto.model_acceptance.first == [1.0, 1000.0]
    auto.propose(_ctx([3, 4]))
    assert auto.model.calls == 0


def test_the_json_template_workload_is_one_template_with_its_own_records(tmp_path):
    from specdeploy.exporter.bench.run import read_prompts
    from specdeploy.exporter.bench.workloads import TEMPLATE, json_template, write

    prompts = read_prompts(write("json-template", tmp_path / "w.jsonl", 64))
    assert prompts == json_template(64) and len(set(prompts)) > 48  # deterministic, mostly distinct records
    head = TEMPLATE.split("{")[0]
    assert all(p.startswith(head) for p in prompts)


def test_auto_is_the_default_and_declines_quietly(tiny_bundle, recwarn):
    """``load(bundle)`` drafts with auto (plain, without a warning, where the plan allows no speculation);
    batched, it drafts with the free source batching has (no n-gram table here: prompt lookup)."""
    import inspect

    from specdeploy.exporter.cli.decode import generate, serve
    from specdeploy.runtime.errors import ExactnessWarning

    assert inspect.signature(load).parameters["draft"].default == "auto"
    assert {p.name: p.default for p in generate.params}["draft"] == "auto"
    assert {p.name: p.default for p in serve.params}["draft"] == "auto"
    with load(tiny_bundle) as engine, load(tiny_bundle, draft=None) as plain:
        assert engine.draft_name == ("auto" if engine.plan.speculate else "none")
        prompt = "one two three four one two three four one two"
        want = plain.generate(prompt=prompt, max_new_tokens=24).text
        assert engine.generate(prompt=prompt, max_new_tokens=24).text == want
    assert not [w for w in recwarn if issubclass(w.category, ExactnessWarning)]
    with load(tiny_bundle, max_batch=2) as batched:  # one meaning of a draft: batched, each sequence keeps its own
        assert batched.draft_name == ("auto" if batched.plan.speculate else "none")
        assert batched.generate(prompt=prompt, max_new_tokens=24).text == want


def test_the_step_clock_prices_a_model_step_in_plain_steps_and_shrugs_off_a_pause(monkeypatch):
    from specdeploy.runtime.drafters import hybrid

    now = [0.0]
    monkeypatch.setattr(hybrid.time, "perf_counter", lambda: now[0])
    clock = hybrid.StepClock()
    for i in range(2 * clock.MIN_SAMPLES + 2):
        clock.tick()
        clock.kind = "model" if i % 2 else "plain"
        now[0] += 0.015 if i % 2 else 0.010  # a model iteration takes 1.5 plain ones
        assert clock.ratio() is None or i >= 2 * clock.MIN_SAMPLES
    clock.tick()
    assert clock.ratio() == pytest.approx(1.5)
    clock.kind = "plain"
    now[0] += 5.0  # the OS paused the process: clipped, the estimate barely moves
    clock.tick()
    assert 1.3 < clock.ratio() < 1.5
    clock.pause()  # between generations nothing is timed
    now[0] += 60.0
    clock.tick()
    assert 1.3 < clock.ratio() < 1.5


def test_a_retry_that_does_not_pay_doubles_the_wait_and_one_that_pays_resets_it():
    from specdeploy.runtime.drafters.hybrid import MAX_RETRY_EVERY

    model = CountingModel()
    alone = PaidDraft(model, chains=True)
    alone.use_cost_curve({1: 1.0, 2: 3.0, 16: 40.0})  # never worth it
    waits, step = [], 0
    while len(waits) < 6:
        before = model.calls
        tree = alone.propose(_ctx([100 + step, 200 + step]))
        alone.accepted(np.array([0]), tree)  # nothing it drafts is accepted
        step += 1
        if model.calls > before:
            waits.append(step)
            step = 0
    assert waits == [RETRY_EVERY + 1, 2 * RETRY_EVERY + 1, 4 * RETRY_EVERY + 1, 8 * RETRY_EVERY + 1,
                     MAX_RETRY_EVERY + 1, MAX_RETRY_EVERY + 1]
    alone.use_cost_curve(FLAT)  # now it pays: after the next retry the rule keeps it, and the wait is reset
    alone.model_acceptance.first = [1000.0, 1.0]
    for i in range(MAX_RETRY_EVERY + 3):
        tree = alone.propose(_ctx([7, 8 + i]))
        alone.accepted(np.array([0, 1, 2]), tree)
    assert alone._retry_every == RETRY_EVERY and alone.sources["model"] > 2


def test_a_spike_in_the_measured_cost_curve_is_brought_down_to_its_neighbours_chord():
    from specdeploy.runtime.cost_curve import without_spikes

    measured = {1: 1.0, 2: 1.04, 4: 2.04, 8: 2.17, 16: 3.44}  # seen at load on a noisy machine: T = 4 spiked
    smooth = without_spikes(measured)
    assert smooth[4] == pytest.approx(1.04 + (2.17 - 1.04) / 3) and smooth[8] == 2.17 and smooth[16] == 3.44
    ordinary = {1: 1.0, 2: 1.11, 4: 1.43, 8: 2.0, 16: 3.1}
    assert without_spikes(ordinary) == ordinary
    assert without_spikes({1: 1.0, 2: 1.6, 4: 1.7})[2] == 1.6  # a 1-row step on its own graph: kept
