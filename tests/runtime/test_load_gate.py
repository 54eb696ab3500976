"""The load gate of a batch (runtime/rows.py ``LoadGate``): whether a step of several sequences asks their whole
drafters, trained drafts included, or only their free parts; both modes measured, the faster kept, and what the
sequences' drafters hear in each."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from decode_checks import BATCH_PROMPTS as PROMPTS
from decode_checks import concurrently
from specdeploy.runtime import load
from specdeploy.runtime.batch import BatchScheduler


def test_the_load_gate_measures_both_modes_and_keeps_the_faster():
    from specdeploy.runtime.rows import LoadGate

    gate = LoadGate()
    modes = []
    for i in range(2 * LoadGate.MIN):  # the modes in turn, over a batch that drains from 4 to 3
        b = 4 if i < LoadGate.MIN else 3
        d = gate.drafting(b)
        modes.append(d)
        gate.record(b, d, (8 if d else 10) * b // 4, 1.0)  # here plain steps give more tokens per second
    assert modes == [True, False] * LoadGate.MIN
    later = [gate.drafting(4) for _ in range(1000)]  # the slower mode, tried for a block now and then
    n = LoadGate.block(4)
    starts = [i for i, d in enumerate(later) if d and not later[i - 1]]
    assert all(later[at : at + n + 1] == [True] * n + [False] for at in starts) and later.count(True) == n * len(starts)
    # each block that leaves the mode as it was puts the next one twice as far
    assert starts[0] == LoadGate.EXPLORE - 1
    assert [b - a - n + 1 for a, b in itertools.pairwise(starts)] == [2 * LoadGate.EXPLORE, 4 * LoadGate.EXPLORE,
                                                                    8 * LoadGate.EXPLORE]
    assert not gate.drafting(3)  # 3 and 4 are measured together
    assert not gate.drafting(5) and not gate.drafting(8)  # 5-8: larger than a pool that runs plain, plain unlearned
    fast = LoadGate()
    for i in range(2 * LoadGate.MIN):  # drafting faster at 4
        d = fast.drafting(4)
        fast.record(4, d, 10 if d else 8, 1.0)
    assert fast.drafting(4) and fast.drafting(5)  # 5-8 learn on their own, drafting first
    fast.record(5, True, 10, 1.0)
    assert not fast.drafting(6)  # then plain
    assert [LoadGate.pool(b) for b in (2, 3, 4, 5, 8, 9, 17, 32, 33)] == [2, 4, 4, 8, 8, 16, 32, 32, 64]
    assert [LoadGate.needed(p) for p in (2, 4, 8, 16, 32, 64)] == [8, 8, 8, 4, 3, 3]  # sequence-iterations suffice
    big = LoadGate()
    for i in range(2 * LoadGate.needed(32)):  # a full batch learns in 3 iterations of each mode
        d = big.drafting(32)
        assert d == (i % 2 == 0)
        big.record(32, d, 32 if d else 40, 1.0)
    assert not big.drafting(30)


def test_the_load_gate_compares_a_fresh_block_of_the_other_mode_with_the_recent_steps():
    """Steps slow down as contexts grow: both modes at half their speed. A rate of the mode not in use kept from
    long ago would beat the fresh one of the mode in use, and the gate would flip to the slower mode until its own
    rate had faded; a block starts its sums afresh, so the slower mode runs its blocks and no more."""
    from specdeploy.runtime.rows import LoadGate

    gate = LoadGate()
    speed = {True: 8.0, False: 10.0}  # tokens per second of 4 sequences: plain is faster
    for _ in range(2 * LoadGate.MIN):
        d = gate.drafting(4)
        gate.record(4, d, speed[d], 1.0)
    slow = []
    for _ in range(1000):
        d = gate.drafting(4)
        slow.append(d)
        gate.record(4, d, speed[d] / 2, 1.0)
    blocks = sum(d and not slow[i - 1] for i, d in enumerate(slow))
    assert blocks == 4 and slow.count(True) == 4 * LoadGate.block(4)  # its blocks (each twice as far), no more
    assert gate.rate(4, True) == pytest.approx(1.0) and gate.rate(4, False) == pytest.approx(1.25, rel=0.01)


def test_a_block_changes_the_mode_only_by_a_margin():
    """A block of a few iterations is noisy: it changes the mode only where it beats the mode in use by
    ``MARGIN``. Where drafting is a little faster the gate stays plain, its blocks ever rarer; where drafting
    becomes much faster, the next block changes the mode, and the blocks of plain come ``EXPLORE`` apart again."""
    from specdeploy.runtime.rows import LoadGate

    gate = LoadGate()
    run = []

    def iterate(count, drafting_speed):
        for _ in range(count):
            d = gate.drafting(4)
            run.append(d)
            gate.record(4, d, drafting_speed if d else 10.0, 1.0)

    iterate(2 * LoadGate.MIN, 9.0)  # learning: plain is faster
    run.clear()
    iterate(1000, 10.0 * (1 + LoadGate.MARGIN / 2))  # drafting a little faster: within the margin
    n = LoadGate.block(4)
    starts = [i for i, d in enumerate(run) if d and (i == 0 or not run[i - 1])]
    assert len(starts) == 4 and run.count(True) == 4 * n  # blocks alone, each twice as far as the last
    run.clear()
    iterate(1200, 13.0)  # much faster: the next block changes the mode
    first = run.index(True)
    assert all(run[first : first + LoadGate.block(4) + LoadGate.EXPLORE - 1])
    plain = [i for i, d in enumerate(run) if not d and i > first]
    assert plain and plain[0] - first == LoadGate.EXPLORE + LoadGate.block(4) - 1  # the other mode's blocks, anew


def test_the_load_gate_compares_rates_per_sequence():
    from specdeploy.runtime.rows import LoadGate

    gate = LoadGate()
    for i in range(2 * LoadGate.MIN):  # drafting at 8 sequences, plain at 5: more tokens in all, fewer per sequence
        d = gate.drafting(8 if i % 2 == 0 else 5)
        gate.record(8 if d else 5, d, 9 if d else 6, 1.0)
    assert gate.drafting(6) is False


def test_a_drafter_that_sat_steps_out_gets_every_state_it_missed(tiny_bundle, monkeypatch):
    # Where the load gate runs plain steps, the drafters are not asked; at their next call ctx.hidden holds the base
    # states of every token accepted since their last call, so a model with a cache of its own can catch up. Nor do
    # they hear of those steps: a drafter hears at most one verdict a proposal (told of a plain step it did not
    # propose, it would count its last draft as rejected again).
    from specdeploy.runtime.drafters.prompt_lookup import PromptLookupDrafter
    from specdeploy.runtime.rows import LoadGate

    calls: dict[int, list[tuple[int, int]]] = {}
    heard: dict[int, int] = {}
    original, verdict = PromptLookupDrafter.propose, PromptLookupDrafter.accepted

    def recorded(self, ctx):
        calls.setdefault(id(self), []).append((len(ctx.hidden), len(ctx.tokens)))
        return original(self, ctx)

    def told(self, nodes, tree):
        heard[id(self)] = heard.get(id(self), 0) + 1
        return verdict(self, nodes, tree)

    monkeypatch.setattr(PromptLookupDrafter, "propose", recorded)
    monkeypatch.setattr(PromptLookupDrafter, "accepted", told)
    flips = iter([True, False, False, True, False] * 1000)
    monkeypatch.setattr(LoadGate, "drafting", lambda self, batch: next(flips))
    with load(tiny_bundle, draft="prompt-lookup", max_batch=4) as eng:
        if not isinstance(eng.scheduler, BatchScheduler):
            pytest.skip(f"no batching on this machine: {eng.batch_reason}")
        concurrently(eng, PROMPTS[:4], max_new_tokens=60)
    assert len(calls) >= 2
    for seen in calls.values():
        given = np.cumsum([rows for rows, _ in seen])
        assert list(given) == [tokens - 1 for _, tokens in seen]  # every accepted token's state, once
    assert heard and all(heard.get(d, 0) <= len(seen) for d, seen in calls.items())


def test_a_step_the_gate_runs_plain_asks_only_each_drafters_recall(tiny_bundle, alone, monkeypatch):
    """In steps of several sequences the load gate runs plain, ``auto``'s suffix drafter (its recall of answers met
    before) is still asked, its drafts get rows where the rows rule finds they pay, and it hears their verdicts;
    lookup and the trained model are asked only in steps of one sequence (where the gate does not judge). The
    answers are generate's."""
    from specdeploy.runtime import decode
    from specdeploy.runtime.drafters.auto import FreeSources
    from specdeploy.runtime.drafters.base import Drafter
    from specdeploy.runtime.drafters.hybrid import HybridDrafter
    from specdeploy.runtime.drafters.prompt_lookup import PromptLookupDrafter
    from specdeploy.runtime.drafters.suffix import SuffixCache, SuffixDrafter
    from specdeploy.runtime.rows import LoadGate
    from specdeploy.runtime.tree import DraftTree

    monkeypatch.setattr("specdeploy.runtime.batch.measure_cost_curve",  # a small model's rows (see test_batch)
                        lambda decoder, largest=None: {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.25, 16: 1.5, 32: 2.0, 64: 3.0})
    monkeypatch.setattr(LoadGate, "drafting", lambda self, batch: False)
    batch = [0]
    step = decode.Decoder.step

    def sized(self, gens, cache_for):
        batch[0] = len(gens)
        return step(self, gens, cache_for)

    monkeypatch.setattr(decode.Decoder, "step", sized)
    calls: dict[str, list[int]] = {"model": [], "lookup": [], "suffix": [], "heard": []}

    class Model(Drafter):
        kind = "chimera"

        def propose(self, ctx):
            calls["model"].append(batch[0])
            return DraftTree.chain([int(ctx.tokens[-1]), 1, 2])

    class Lookup(PromptLookupDrafter):
        def propose(self, ctx):
            calls["lookup"].append(batch[0])
            return super().propose(ctx)

    class Suffix(SuffixDrafter):
        def draft(self, ctx, bar=None):
            calls["suffix"].append(batch[0])
            return super().draft(ctx, bar)

        def accepted(self, nodes, tree):
            calls["heard"].append(batch[0] if len(nodes) > 1 else 0)
            super().accepted(nodes, tree)

        def observed(self, emitted):
            calls["heard"].append(batch[0])
            super().observed(emitted)

    cache = SuffixCache()  # shared, as the engine's is

    def factory(*args, **kwargs):
        def make():
            free = FreeSources(Lookup(branches=1, num_tokens=10), Suffix(cache, chains=True, local=False))
            return HybridDrafter(Model(), lookup=free, chains=True)
        return make

    monkeypatch.setattr("specdeploy.runtime.engine.drafter_factory", factory)
    with load(tiny_bundle, draft="prompt-lookup", max_batch=4) as eng:
        if not isinstance(eng.scheduler, BatchScheduler):
            pytest.skip(f"no batching on this machine: {eng.batch_reason}")
        first = [eng.generate(p, max_new_tokens=300) for p in PROMPTS[:4]]  # alone: the cache meets the answers
        for seen in calls.values():
            seen.clear()
        again = concurrently(eng, PROMPTS[:4], max_new_tokens=300)
    assert all(b == 1 for b in calls["model"] + calls["lookup"])  # several sequences: only the recall was asked
    assert sum(b > 1 for b in calls["suffix"]) > 50
    assert sum(b > 1 for b in calls["heard"]) > 5  # it drafted answers met before, and heard how they fared
    for a, b, c in zip(alone, first, again):
        assert a.token_ids == b.token_ids == c.token_ids
