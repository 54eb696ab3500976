"""Continuous batching (runtime/batch.py): a batched answer is the one ``generate`` gives on the same bundle (at
max_batch 1, 4 and 8), every sequence drafts in a batch, the rows rule fades drafts with load, rows join and leave at
step boundaries, cancellation, the rows probe and its fallbacks, and the refusals."""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings

import numpy as np
import pytest
from decode_checks import BATCH_PROMPTS as PROMPTS
from decode_checks import concurrently, pairs_fit
from specdeploy.runtime import load
from specdeploy.runtime.batch import BatchScheduler
from specdeploy.runtime.errors import DraftMismatchError, ExactnessWarning, SpecDeployError
from specdeploy.runtime.kvcache import bucket_for
from specdeploy.runtime.plan import ROWS_CHECK
from specdeploy.runtime.rows import rows_per_sequence


@pytest.mark.parametrize(("draft", "max_batch", "lone"),
                         [(None, 4, False), ("prompt-lookup", 4, False), ("auto", 8, False), ("prompt-lookup", 4, True)])
def test_a_batched_answer_is_the_one_generate_gives(tiny_bundle, alone, draft, max_batch, lone, monkeypatch):
    # The tiny model's step costs measured at load are mostly the machine's noise (on a busy machine 8 rows once
    # measured 6x one row), which may rightly stop every draft: rows cost what a small model's rows cost here.
    monkeypatch.setattr("specdeploy.runtime.batch.measure_cost_curve",
                        lambda decoder, largest=None: {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.25, 16: 1.5, 32: 2.0, 64: 3.0})
    waits = []
    if lone:  # the first sequence with a draft runs alone whenever the rule lets one: the others hold theirs
        from specdeploy.runtime.rows import MAX_WAIT, LoadGate

        monkeypatch.setattr(LoadGate, "drafting", lambda self, batch: True)

        def first(expected, cost, min_rows, rows, waited):
            waits.extend(waited)
            drafted = [i for i, e in enumerate(expected) if len(e) > 1]
            return (drafted[0], len(expected[drafted[0]])) if drafted and max(waited) < MAX_WAIT else None

        monkeypatch.setattr("specdeploy.runtime.decode.lone_step", first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = load(tiny_bundle, draft=draft, max_batch=max_batch)
    with eng:
        batching = isinstance(eng.scheduler, BatchScheduler)
        assert batching == eng.plan.rows  # batches exactly where the probe found rows invariant here
        if not batching:  # else one at a time, and it says so once
            assert [str(w.message).startswith("Batching is off:") for w in caught].count(True) == 1
        steps_before = getattr(eng.scheduler, "steps", 0)
        batched = concurrently(eng, PROMPTS, max_new_tokens=300)
        deadline = time.monotonic() + 10  # a row leaves just after its caller got its last token
        while eng.stats().running and time.monotonic() < deadline:
            time.sleep(0.01)
        st = eng.stats()
        assert eng.fingerprint.endswith("-exact")
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.text == b.text
    assert st.running == 0 and st.queue_depth == 0 and all(not b.stats.lossy for b in batched)
    if batching:
        tokens = sum(len(b.token_ids) for b in batched)
        assert eng.scheduler.steps - steps_before < 0.6 * tokens  # shared steps, far fewer than tokens
        if draft is not None:  # sequences drafted (lookup chains) inside the batch, not only when alone
            assert max(max(b.stats.tree_sizes) for b in batched) > 1
        if lone:  # many ran alone, and none sat out more than MAX_WAIT steps in a row
            assert eng.decoder.lone_steps > 20 and max(waits) == MAX_WAIT


def test_the_rows_rule_drafts_where_rows_pay_and_fades_with_load():
    def linear(per_row: float):  # a step's cost against a 1-row step's: one, plus per_row for each further row
        return lambda rows: 1.0 + per_row * (rows - 1)

    sure = [1.0, 1.9, 2.7, 3.4]  # a draft whose tokens are nearly always accepted (3 drafted tokens)
    # alone on a CPU (a row costs 0.15 of a step) the whole chain pays; where rows cost a full step, none does
    assert rows_per_sequence([sure], linear(0.15)) == 4
    assert rows_per_sequence([sure], linear(1.0)) == 1
    # 16 sequences: the batch is already compute-bound, so a draft row costs what a sequence's row costs
    assert rows_per_sequence([sure] * 16, linear(0.9)) == 1
    # a batch of cheap rows (a GPU) drafts for everyone, as deep as pays for the batch
    assert rows_per_sequence([sure] * 16, linear(0.01)) == 4
    # sequences without drafts pad to the step's rows: one sure drafter among 8 plain ones does not pay
    assert rows_per_sequence([sure] + [[1.0]] * 7, linear(0.15)) == 1
    # a plan that pads every step to 2 rows makes a 1-token draft free
    assert rows_per_sequence([[1.0, 1.3]] * 4, linear(0.5), min_rows=2) == 2


def test_one_sequence_runs_alone_where_its_draft_alone_returns_more_than_the_batchs_step():
    from specdeploy.runtime.rows import MAX_WAIT, lone_step

    curve = {1: 1.0, 2: 1.13, 4: 1.54, 8: 2.42, 16: 4.08, 32: 8.0, 64: 16.0}

    def cost(rows):
        lo = max(k for k in curve if k <= rows)
        hi = min((k for k in curve if k >= rows), default=lo)
        return curve[lo] if hi == lo else curve[lo] + (curve[hi] - curve[lo]) * (rows - lo) / (hi - lo)

    replay = [1.0 + 0.95 * j for j in range(9)]  # an answer met before: 8 tokens, each near-certain
    guess = [1.0, 1.4, 1.6]  # n-gram guesses
    batch = [replay, guess, guess, guess]
    rows = rows_per_sequence(batch, cost)
    assert rows < 9 and lone_step(batch, cost, 1, rows, [0, 0, 0, 0]) == (0, 9)  # padded to 9 rows it does not pay
    assert lone_step(batch, cost, 1, rows, [0, MAX_WAIT, 0, 0]) is None  # one has waited long enough: all step
    assert lone_step([replay] * 4, cost, 1, rows_per_sequence([replay] * 4, cost), [0] * 4) is None  # all sure
    assert lone_step([guess] * 4, cost, 1, rows_per_sequence([guess] * 4, cost), [0] * 4) is None


def test_the_shared_cache_holds_the_rows_its_sequences_need(tiny_bundle, alone, monkeypatch):
    """One request at a time on a max_batch 8 engine runs on a cache of one row; three at once on rows in doublings
    (never 8); the cache shrinks back when the batch empties. It grows to the smallest bucket of columns that holds
    the step and a sixteenth spare (every step reads every column), unless it has more already. Every answer is still
    generate's, with every cache buffer in ordinary pages of its own (as a large one is,
    :func:`~specdeploy.runtime.kvcache.zeroed`)."""
    import mmap

    monkeypatch.setattr("specdeploy.runtime.kvcache.SMALL_PAGES_FROM", 0)
    with load(tiny_bundle, draft="prompt-lookup", max_batch=8) as eng:
        if not isinstance(eng.scheduler, BatchScheduler):
            pytest.skip(f"no batching on this machine: {eng.batch_reason}")
        made = []
        new_cache = eng.backend.new_cache
        eng.backend.new_cache = lambda batch, capacity: made.append(batch) or new_cache(batch, capacity)
        sched, fits = eng.scheduler, []
        fit = sched._fit

        def fit_and_see(need: int, sequences: int = 0) -> None:
            before, growing = sched._full.capacity, bool(sched.rows)
            fit(need, sequences)
            fits.append((need, before, sched._full.capacity, growing))

        sched._fit = fit_and_see
        one = eng.generate(PROMPTS[0], max_new_tokens=300)
        assert made and set(made) == {1} and eng.scheduler.cache_rows == 1
        made.clear()
        three = concurrently(eng, PROMPTS[1:4], max_new_tokens=300)
        assert 2 <= max(made) <= 4 and eng.scheduler.cache_rows <= 4
        assert isinstance(eng.scheduler._full.keys[0].base.base.obj, mmap.mmap)
        assert eng.generate(PROMPTS[4], max_new_tokens=8) and eng.scheduler.cache_rows == 1
    grown = [(need, cap, growing) for need, before, cap, growing in fits if cap > before]
    assert len(grown) >= 2 and all(cap == bucket_for(need + need // 16 if growing else need, sched.buckets)
                                   for need, cap, growing in grown), grown
    for a, b in zip(alone[:4], [one, *three]):
        assert a.token_ids == b.token_ids


def test_seeded_sampling_in_a_batch_is_the_same_as_alone(tiny_bundle):
    kw = {"max_new_tokens": 40, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    with load(tiny_bundle, max_batch=3, draft=None) as eng:
        alone = eng.generate(PROMPTS[2], **kw)
        res = concurrently(eng, [PROMPTS[2], PROMPTS[0], PROMPTS[1]], **kw)
    assert res[0].token_ids == alone.token_ids


def test_cancel_and_queue_beyond_max_batch(tiny_bundle):
    with load(tiny_bundle, max_batch=2, draft=None) as eng:
        # Hold the decode steps once two rows share them (prefills and a lone row's steps pass), so the test
        # sees the batch and the queue as they are.
        gate, step = threading.Event(), eng.backend.step
        eng.backend.step = lambda inputs, cache: (gate.wait(60), step(inputs, cache))[1] \
            if inputs.input_ids.shape[0] == 2 else step(inputs, cache)
        streams = [eng.stream(PROMPTS[4], max_new_tokens=400) for _ in range(4)]
        texts: dict[int, str] = {}

        def read(i: int) -> None:
            texts[i] = "".join(streams[i])

        readers = [threading.Thread(target=read, args=(i,)) for i in range(4)]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 30  # the streams queue at their first next(), in their threads

        def settled() -> bool:  # two rows admitted and both prefilled (a joining row counts as running first)
            st = eng.stats()
            return (st.running, st.queue_depth) == (2, 2) and sum(s.stats.prefill_s > 0 for s in streams) == 2

        while not settled() and time.monotonic() < deadline:
            time.sleep(0.01)
        st = eng.stats()
        assert st.running == 2 and st.queue_depth == 2  # two decode, two wait for a row
        queued = next(i for i in range(4) if streams[i].stats.prefill_s == 0)
        streams[queued].close()  # a queued request leaves the queue ...
        running = next(i for i in range(4) if streams[i].stats.prefill_s > 0)
        streams[running].close()  # ... and a running one the batch, after its step
        gate.set()
        for t in readers:
            t.join(120)
        assert streams[queued].completion.finish_reason == "cancelled"
        assert streams[running].completion.finish_reason == "cancelled"
        done = [i for i in range(4) if i not in (queued, running)]
        assert all(streams[i].completion.finish_reason == "length" for i in done)
        assert all(len(streams[i].completion.token_ids) == 400 for i in done)
        assert eng.stats().cancelled == 2 and eng.stats().running == 0
        # Still serving afterwards, and a closed engine refuses new work in one sentence.
        assert eng.generate(PROMPTS[4], max_new_tokens=4).finish_reason in ("stop", "length")
    with pytest.raises(SpecDeployError, match="closed"):
        eng.stream(PROMPTS[0])


def test_close_cancels_running_and_queued(tiny_bundle):
    eng = load(tiny_bundle, max_batch=1 + 1, draft=None)
    sched = eng.scheduler
    seen = []  # (active, waiting) as each request is finished
    finish = sched._finish

    def recording_finish(seq, reason):
        seen.append((sched.active, sched.waiting))
        finish(seq, reason)

    sched._finish = recording_finish
    streams = [eng.stream(p, max_new_tokens=480) for p in PROMPTS[:3]]
    threads = [threading.Thread(target=lambda s=s: list(s), daemon=True) for s in streams]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    # every request submitted (a stream submits when its thread first iterates it) and one prefilled
    while (len(seen) + sched.active + sched.waiting < 3 or not any(s.stats.prefill_s for s in streams)) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    eng.close()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert streams[0].completion.finish_reason in ("cancelled", "length", "stop")
    assert len(seen) == 3 and seen[-1] == (0, 0)  # closing frees every row and queue entry first
    assert (sched.active, sched.waiting) == (0, 0)


def test_the_rows_probe_catches_a_differing_row_and_batching_then_falls_back(tiny_bundle, monkeypatch):
    from specdeploy.runtime.backends.ort import OrtBackend

    real_step = OrtBackend.step

    def off_in_a_batch(self, inputs, cache):  # a kernel whose rows round otherwise when sequences share a step
        out = real_step(self, inputs, cache)
        if inputs.input_ids.shape[0] > 1:
            out = dataclasses.replace(out, logits=np.nextafter(out.logits, np.float32(np.inf)))
        return out

    monkeypatch.setattr(OrtBackend, "step", off_in_a_batch)
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tiny_bundle.parent / "fresh-verdicts"))  # probed afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with load(tiny_bundle, max_batch=4, draft=None) as eng:
            assert not eng.plan.rows and eng.scheduler.max_batch == 1 and eng.max_batch == 1
            checks = [c for r in eng.plan.probes for c in r.checks if c.what.startswith(ROWS_CHECK)]
            assert checks and not any(c.passed for c in checks)  # each gathered plan was tried, and differed
            assert eng.generate(PROMPTS[0], max_new_tokens=4).stats.lossy is False
            assert eng.fingerprint.endswith("-exact")
    msgs = [str(w.message) for w in caught if issubclass(w.category, ExactnessWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("Batching is off:") and msgs[0].count(". ") == 0
    with load(tiny_bundle, max_batch=4, allow_inexact=True, draft=None) as eng:
        assert eng.scheduler.max_batch == 4 and eng.batch_reason.startswith("LOSSY")
        assert eng.generate(PROMPTS[0], max_new_tokens=4).stats.lossy is True
        assert eng.fingerprint.endswith("-lossy")


def test_batching_refusals_are_one_sentence(tiny_bundle):
    with pytest.raises(DraftMismatchError) as err:  # a draft the bundle lacks: at load, before anything is served
        load(tiny_bundle, draft="chimera", max_batch=2)
    assert str(err.value).count(". ") == 0
    with pytest.raises(SpecDeployError, match="at least 1"):
        load(tiny_bundle, max_batch=0, draft=None)


def test_sampling_in_a_batch_with_three_requests_in_flight_is_exact(tiny_bundle, monkeypatch):
    """5,000 two-token samples, each beside three other requests in the same steps and with drafts for its second
    token verified by tree rejection sampling: their joint distribution is the base's (chi-square, p > 0.05;
    :func:`~decode_checks.pairs_fit`)."""
    from specdeploy.runtime.drafters.prompt_lookup import PromptLookupDrafter
    from specdeploy.runtime.rows import LoadGate
    from specdeploy.runtime.tree import DraftTree
    from specdeploy.runtime.verify import warp_logits

    # Drafts in every step, verified whole: the random model's samples rarely repeat the prompt, so the samplers'
    # second token is drafted as its likeliest value (accepted often, rejected often), the others' by lookup.
    monkeypatch.setattr(LoadGate, "drafting", lambda self, batch: True)
    monkeypatch.setattr("specdeploy.runtime.batch.measure_cost_curve",
                        lambda decoder, largest=None: {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08, 32: 1.16})
    likeliest: dict[int, int] = {}
    lookup = PromptLookupDrafter.propose

    def propose(self, ctx):
        a = int(ctx.tokens[-1])
        if len(ctx.tokens) == len(ids) + 1 and a in likeliest:
            return DraftTree.chain([a, likeliest[a]])
        return lookup(self, ctx)

    monkeypatch.setattr(PromptLookupDrafter, "propose", propose)

    warp = {"temperature": 1.5, "top_k": 4}
    prompt = "a b a b a b a b a b a b"
    with load(tiny_bundle, draft="prompt-lookup", max_batch=8) as eng:
        if not isinstance(eng.scheduler, BatchScheduler):
            pytest.skip(f"no batching on this machine: {eng.batch_reason}")
        ids = eng.encode(prompt)

        def probs(tokens):  # the warped base distribution after ``tokens`` (rows are the same alone or batched)
            return warp_logits(eng.decoder.prefill(tokens)[0].root_logits, **warp)

        first = probs(ids)
        expected = {(a, b): first[a] * p for a in np.flatnonzero(first) for b, p in enumerate(probs(ids + [a])) if p}
        for a in np.flatnonzero(first):
            likeliest[int(a)] = int(np.argmax(probs(ids + [int(a)])))
        stop = threading.Event()

        def others(i: int) -> None:  # three long requests always in flight
            while not stop.is_set():
                eng.generate(PROMPTS[i], max_new_tokens=200, temperature=0.8, seed=None)

        busy = [threading.Thread(target=others, args=(i,), daemon=True) for i in range(3)]
        for t in busy:
            t.start()
        drafted: list[bool] = []
        shared: list[int] = []

        def draw(n: int) -> list[tuple[int, ...]]:
            pairs: list[tuple[int, ...]] = []

            def sample(k: int) -> None:  # four samplers at once: steps shared with the others and with each other
                # three tokens, so that the step after the prefill can verify a lookup draft for the second
                runs = [eng.generate(prompt, max_new_tokens=3, **warp) for _ in range(k)]
                pairs.extend(tuple(r.token_ids[:2]) for r in runs)
                drafted.extend(max(r.stats.tree_sizes, default=1) > 1 for r in runs)

            samplers = [threading.Thread(target=sample, args=(n // 4,)) for _ in range(4)]
            for t in samplers:
                t.start()
            for t in samplers:
                t.join(600)
            shared.append(eng.stats().running)  # the others were still decoding beside the last ones
            return pairs

        try:
            p = pairs_fit(draw, expected)
        finally:
            stop.set()
            for t in busy:
                t.join(60)
    assert min(shared) >= 3
    assert sum(drafted) > len(drafted) // 2, sum(drafted)  # drafts were verified in the batch (rejection sampling)
    assert p > 0.05, p


def test_the_gathered_graph_takes_rows_apart_and_an_older_bundle_serves_one_at_a_time(tiny_bundle, tmp_path):
    import json
    import shutil

    from specdeploy.runtime.bundle import read_manifest

    assert read_manifest(tiny_bundle).tree_graph().rows_apart  # what export base writes now
    old = tmp_path / "old"
    shutil.copytree(tiny_bundle, old)
    raw = json.loads((old / "manifest.json").read_text())
    for g in raw["graphs"]:
        g.pop("rows_apart", None)  # as a bundle written before the gathered graph took rows of several sequences
    (old / "manifest.json").write_text(json.dumps(raw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with load(old, max_batch=4, draft=None) as eng:
            assert eng.max_batch == 1 and not eng.plan.rows
            assert eng.generate(PROMPTS[0], max_new_tokens=4).finish_reason in ("stop", "length")
    msgs = [str(w.message) for w in caught if issubclass(w.category, ExactnessWarning)]
    assert len(msgs) == 1 and "predates rows of several sequences" in msgs[0] and "re-export" in msgs[0]
