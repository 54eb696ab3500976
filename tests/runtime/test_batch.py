"""Continuous batching (runtime/batch.py): batched greedy output equals the same request alone, rows join
and leave at step boundaries, cancellation, the batch probe and its fallback, and the refusals."""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings

import pytest
from decode_checks import concurrently
from specdeploy.runtime import load
from specdeploy.runtime.batch import batch_refusal
from specdeploy.runtime.batch_probe import BatchVerdict, probe_batch
from specdeploy.runtime.bundle import BATCH_TARGET, read_manifest
from specdeploy.runtime.errors import (
    BackendUnavailableError,
    BundleError,
    DraftMismatchError,
    ExactnessWarning,
    SpecDeployError,
)

# Repetitive prompts give prompt lookup something to find; the varied lengths make rows of other lengths.
PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat",
           "one two three four one two three four one two three",
           "Story: once upon a time in Paris",
           "a b c d e f g a b c d e f g a b c d",
           "Write a poem about rivers.",
           "x y z x y z x y z x y z x y z x y z x y z x y z",
           "Hello",
           "red green blue red green blue red"]


@pytest.mark.parametrize("draft", [None, "prompt-lookup"])
def test_batched_greedy_equals_alone(tiny_bundle, draft):
    # 300 new tokens pass 256 columns, so the shared cache grows under load (rows copied).
    kw = {"max_new_tokens": 300, "temperature": 0.0}
    with load(tiny_bundle, draft=draft, max_batch=4) as eng:
        assert eng.max_batch == 4 and eng.scheduler.max_batch == 4
        lone_drafts = eng.scheduler.draft
        alone = [eng.generate(p, **kw) for p in PROMPTS]
        steps_before = eng.scheduler.steps
        batched = concurrently(eng, PROMPTS, **kw)
        steps = eng.scheduler.steps - steps_before
        deadline = time.monotonic() + 10  # a row leaves just after its caller got its last token
        while eng.stats().running and time.monotonic() < deadline:
            time.sleep(0.01)
        st = eng.stats()
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.text == b.text
    tokens = sum(len(b.token_ids) for b in batched)
    # Shared steps: far fewer steps than tokens decoded one sequence at a time.
    assert steps < 0.6 * tokens, (steps, tokens)
    assert st.running == 0 and st.queue_depth == 0
    assert all(not b.stats.lossy for b in batched)
    if lone_drafts:
        assert max(a.stats.mean_accepted for a in alone) > 1.0  # lookup paid somewhere alone


def _plan_with_rows(monkeypatch, min_rows: int) -> None:
    """Make the engine's step plan this machine's, but with ``min_rows`` (as a machine whose exact plan is that)."""
    from specdeploy.runtime import engine as engine_mod
    from specdeploy.runtime.plan import Candidate

    real = engine_mod.resolve_plan

    def plan(*a, **k):
        p = real(*a, **k)
        return dataclasses.replace(p, candidate=Candidate(f"rows-{min_rows}", False, min_rows), speculate=True,
                                   exact=True, max_rows=max(p.max_rows, 4))

    monkeypatch.setattr(engine_mod, "resolve_plan", plan)


def test_prompt_lookup_drafts_for_a_lone_sequence_and_not_in_a_shared_step(tiny_bundle, monkeypatch):
    # The mechanics, whatever this machine's plan: a lone row drafts where the plan needs no padding rows (and
    # batches, labelled lossy, where its chains' rows differ from plain ones here).
    _plan_with_rows(monkeypatch, 1)
    with load(tiny_bundle, draft="prompt-lookup", max_batch=2, allow_inexact=True) as eng:
        sched = eng.scheduler
        assert sched.max_batch == 2 and sched.draft and sched.cost[1] == 1.0 and len(sched.cost) > 1  # T-row step costs, measured
        lone = eng.generate(PROMPTS[5], max_new_tokens=64)
        assert lone.stats.mean_accepted > 1.0 and max(lone.stats.tree_sizes) > 1
        # Two rows share every step: no drafts (a step of several rows per sequence multiplies the work).
        sched.rows = [object()] * 2  # type: ignore[list-item]
        try:
            assert sched._draft() == (0, [])
        finally:
            sched.rows = []
        res = concurrently(eng, PROMPTS[:4], max_new_tokens=64)
        assert all(r.finish_reason in ("stop", "length") for r in res)


def test_a_plan_that_pads_plain_steps_keeps_a_lone_row_plain(tiny_bundle, monkeypatch):
    # Batched steps take one row per sequence: a plan that pads plain steps to two rows cannot batch them,
    # and a lone row drafting on it would compute its rows otherwise than in a batch.
    _plan_with_rows(monkeypatch, 2)
    with load(tiny_bundle, draft="prompt-lookup", max_batch=2) as eng:
        assert not eng.scheduler.draft and eng.scheduler.max_rows == 1
        assert "decodes plainly too" in eng.batch_reason and "pads plain steps to 2 rows" in eng.batch_reason
        lone = eng.generate(PROMPTS[5], max_new_tokens=16)
        assert max(lone.stats.tree_sizes) == 1
        res = concurrently(eng, PROMPTS[:3], max_new_tokens=16)
        assert all(r.finish_reason in ("stop", "length") for r in res)


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
            if inputs.input_ids.shape == (2, 1) else step(inputs, cache)
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


def test_probe_passes_here_catches_a_differing_row_and_a_failing_probe_turns_batching_off(tiny_bundle, monkeypatch):
    from specdeploy.runtime import batch_probe
    from specdeploy.runtime.batch import batch_backend
    from specdeploy.runtime.plan import Candidate, ProbeCheck, ProbeResult

    manifest = read_manifest(tiny_bundle)
    backend = batch_backend(tiny_bundle, manifest, 1)
    verdict = probe_batch(backend, manifest, chains=False, use_cache=False)
    assert verdict.exact and "bit for bit" in verdict.reason
    assert len(verdict.results[0].checks) == 3 and all(c.passed for c in verdict.results[0].checks)
    real_step = batch_probe._step

    def off_in_a_batch(backend, cache, ids, past, min_batch=1):  # a kernel whose 3-row batches round otherwise
        logits, hidden = real_step(backend, cache, ids, past, min_batch)
        return (logits + 1e-6, hidden) if ids.shape[0] == 3 else (logits, hidden)

    monkeypatch.setattr(batch_probe, "_step", off_in_a_batch)
    caught = probe_batch(backend, manifest, chains=False, use_cache=False)
    assert not caught.exact and "differ" in caught.reason and "batch row" in caught.reason
    assert len(caught.results) == 2  # a lone row as one row, then as two: both differ

    def off_alone(backend, cache, ids, past, min_batch=1):  # a kernel whose one-row steps round otherwise
        logits, hidden = real_step(backend, cache, ids, past, min_batch)
        return (logits + 1e-6, hidden) if ids.shape[0] * ids.shape[1] == 1 and min_batch == 1 else (logits, hidden)

    monkeypatch.setattr(batch_probe, "_step", off_alone)
    padded = probe_batch(backend, manifest, chains=False, use_cache=False)
    assert padded.exact and padded.min_batch == 2 and "run as two rows" in padded.reason
    monkeypatch.setattr(batch_probe, "_step", real_step)
    backend.close()

    failing = BatchVerdict(False, (ProbeResult(Candidate("batch-rows", False, 1),
                                               (ProbeCheck("batch row, step 1", 3e-5),), 0.0),))
    monkeypatch.setattr("specdeploy.runtime.engine.probe_batch", lambda *a, **k: failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with load(tiny_bundle, max_batch=4, draft=None) as eng:
            assert eng.scheduler.max_batch == 1 and not eng.scheduler.lossy
            assert eng.generate(PROMPTS[0], max_new_tokens=4).stats.lossy is False
    msgs = [str(w.message) for w in caught if issubclass(w.category, ExactnessWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("Batching is off:") and msgs[0].count(". ") == 0
    with load(tiny_bundle, max_batch=4, allow_inexact=True, draft=None) as eng:
        assert eng.scheduler.max_batch == 4 and eng.batch_reason.startswith("LOSSY")
        assert eng.generate(PROMPTS[0], max_new_tokens=4).stats.lossy is True


def test_a_lone_row_runs_as_two_rows_where_the_probe_says_so(tiny_bundle, monkeypatch):
    # A machine whose kernels compute a lone row otherwise than a row of a batch (an AVX2 EPYC with int8
    # activations): its plain steps alone get a dropped copy of the row, and answers stay those alone.
    from specdeploy.runtime import engine as engine_mod

    real = engine_mod.probe_batch
    monkeypatch.setattr(engine_mod, "probe_batch",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), min_batch=2))
    with load(tiny_bundle, draft=None, max_batch=3) as eng:
        assert eng.scheduler.min_batch == 2 and "run as two rows" in eng.batch_reason
        rows: list[int] = []
        step = eng.backend.step
        eng.backend.step = lambda inputs, cache: rows.append(inputs.input_ids.shape) or step(inputs, cache)
        alone = [eng.generate(p, max_new_tokens=24) for p in PROMPTS[:3]]
        plain = [b for b, t in rows if t == 1]  # decode steps (a prefill runs its prompt alone, as one row)
        assert len(plain) >= 3 * 20 and set(plain) == {2}
        batched = concurrently(eng, PROMPTS[:3], max_new_tokens=24)
    assert [a.token_ids for a in alone] == [b.token_ids for b in batched]


def test_batching_refusals_are_one_sentence(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    with pytest.raises(DraftMismatchError, match="prompt lookup or ngram only"):
        load(tiny_bundle, draft="chimera", max_batch=2)
    with pytest.raises(BackendUnavailableError, match="ort-cpu backend only"):
        load(tiny_bundle, backend="ort-cuda", max_batch=2, draft=None)
    with pytest.raises(SpecDeployError, match="at least 1"):
        load(tiny_bundle, max_batch=0, draft=None)
    assert batch_refusal(manifest, "ort-cpu", "prompt-lookup") is None
    old = dataclasses.replace(manifest, graphs=tuple(g for g in manifest.graphs if g.target != BATCH_TARGET))
    why = batch_refusal(old, "ort-cpu", None)
    assert isinstance(why, BundleError) and "no batching graph" in str(why) and str(why).count(". ") == 0
