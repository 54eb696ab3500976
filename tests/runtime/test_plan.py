"""The step plan (``runtime/plan.py``, ``plan_choice.py``, ``verdicts.py``): the probe catches a row that
differs, the runtime runs the plan the probe allows, the verdict is cached per machine, and without an exact
plan speculation is refused with one sentence (or runs labelled lossy when allowed).

No test here asserts what this machine's kernels do: only that the runtime's choice follows the probe.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from specdeploy.exporter.cli import main
from specdeploy.runtime import load, plan
from specdeploy.runtime import probe as probe_mod
from specdeploy.runtime import verdicts as verdict_cache
from specdeploy.runtime.backends.base import Backend, StepOutputs
from specdeploy.runtime.decode import DecodeStats, GenerationConfig
from specdeploy.runtime.errors import ExactnessWarning
from specdeploy.runtime.plan import Candidate, ProbeCheck, ProbeResult
from specdeploy.runtime.plan_choice import candidates, choose, probe_depth
from specdeploy.runtime.probe import probe, resolve_plan

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "one two three four one two three four one two",
]


class OneRowSkew(Backend):
    """The bundle's backend, but a 1-row step's logits are one ulp off, as some CPUs' 1-row kernels are."""

    def __init__(self, inner: Backend):
        self.inner, self.manifest, self.name, self.threads = inner, inner.manifest, "skew", inner.threads

    @property
    def mask_dtype(self):
        return self.inner.mask_dtype

    def new_cache(self, batch, capacity):
        return self.inner.new_cache(batch, capacity)

    def step(self, inputs, cache):
        out = self.inner.step(inputs, cache)
        if inputs.input_ids.shape[1] == 1:
            return StepOutputs(np.nextafter(out.logits, np.float32(np.inf)), out.hidden_states)
        return out


def test_probe_catches_a_one_ulp_row_difference(tiny_bundle):
    with load(tiny_bundle, draft=None) as engine:
        skew = OneRowSkew(engine.backend)
        res = probe(skew, engine.manifest, Candidate("one-graph", False, 1), depth=6)
        assert not res.chains_exact and 0 < res.worst().max_abs < 1e-3
        assert res.checks[0].what == "chain T=2"  # the first failing length ends the probe
        # Two rows per step never runs a 1-row step, so the skew cannot reach it: its verdict is the
        # inner backend's, the same as the inner backend's own probe of that candidate.
        two = Candidate("two-rows", False, 2)
        assert probe(skew, engine.manifest, two, 6).chains_exact == probe(engine.backend, engine.manifest, two,
                                                                           6).chains_exact
        chosen = resolve_plan(skew, engine.manifest, use_cache=False)
        assert chosen.candidate.name != "one-graph" and "one-graph" in chosen.reason


def test_runtime_runs_the_plan_the_probe_allows(tiny_bundle):
    with load(tiny_bundle, draft="prompt-lookup") as engine:
        fresh = resolve_plan(engine.backend, engine.manifest, use_cache=False)
        got = engine.plan
        # the plan its verdicts allow (timings decide between exact plans near a cost limit, so a fresh probe's
        # choice may differ there), and those verdicts are the machine's: a fresh probe finds the same
        mine = choose(list(got.probes), probe_depth(engine.manifest.limits.max_tree))
        assert (got.candidate, got.speculate, got.exact, got.trees) == (mine.candidate, mine.speculate, mine.exact,
                                                                         mine.trees)
        verdicts = {r.candidate: (r.chains_exact, r.trees_exact) for r in fresh.probes}
        assert all(verdicts[r.candidate] == (r.chains_exact, r.trees_exact) for r in got.probes
                   if r.candidate in verdicts)
        dec = engine.decoder
        assert dec.plan is got and dec.min_rows == got.min_rows and dec.chains_only == (not got.trees)
        assert (dec.drafter is not None) == got.speculate
        if got.speculate:
            assert got.exact and not got.lossy and dec.max_tree <= plan.PROBE_DEPTH


@pytest.mark.parametrize("skewed", [False, True])
def test_chosen_plan_gives_speculative_equal_plain(tiny_bundle, skewed):
    """Whatever the plan, greedy speculation on it equals plain decoding on it; on the skewed backend
    the 1-row plan is refused, and the plan the probe picks instead keeps the identity."""

    with load(tiny_bundle, draft=None) as engine:
        backend = OneRowSkew(engine.backend) if skewed else engine.backend
        chosen = resolve_plan(backend, engine.manifest, use_cache=False)
        for stats in _speculative_equals_plain(engine, backend, chosen):
            assert not stats.lossy


def _speculative_equals_plain(engine, backend, step_plan) -> list[DecodeStats]:
    """Greedy prompt lookup against plain decoding on ``step_plan``, per prompt; returns the stats."""
    from specdeploy.runtime.decode import Decoder
    from specdeploy.runtime.drafters import PromptLookupDrafter

    plain = Decoder(backend, engine.manifest, None, plan=step_plan)
    spec = Decoder(backend, engine.manifest, PromptLookupDrafter(), plan=step_plan)
    out = []
    for text in PROMPTS:
        ids = engine.encode(text)
        out.append(DecodeStats())
        assert list(spec.generate(ids, GenerationConfig(32), out[-1])) == list(plain.generate(ids, GenerationConfig(32)))
    return out


def _failing(cand: Candidate) -> ProbeResult:
    return ProbeResult(cand, (ProbeCheck("chain T=2", 0.25),), 1.0)


def test_no_exact_plan_falls_back_to_plain_with_one_sentence(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))  # no verdict cached by other tests
    monkeypatch.setattr(probe_mod, "probe", lambda backend, manifest, cand, depth: _failing(cand))
    with load(tiny_bundle, draft=None) as ref_engine:
        ids = ref_engine.encode(PROMPTS[1])
        ref = ref_engine.generate_ids(ids, GenerationConfig(24))
        assert not ref_engine.plan.speculate
    with pytest.warns(ExactnessWarning) as caught:
        engine = load(tiny_bundle, draft="prompt-lookup")
    with engine:
        [w] = caught
        msg = str(w.message)
        assert msg.count(". ") == 0 and msg.endswith(".") and "plain decoding only" in msg and "0.25" in msg
        assert engine.draft_name == "none" and engine.decoder.drafter is None
        stats = DecodeStats()
        assert engine.generate_ids(ids, GenerationConfig(24), stats) == ref
        assert not stats.lossy and stats.steps == 23  # plain: one token a step
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExactnessWarning)  # allowed: no warning, but labelled
        with load(tiny_bundle, draft="prompt-lookup", allow_inexact=True) as lossy:
            assert lossy.plan.lossy and lossy.plan.trees and "LOSSY" in lossy.plan.reason
            stats = DecodeStats()
            lossy.generate_ids(ids, GenerationConfig(24), stats)
            assert stats.lossy and stats.steps < 23  # it did speculate
            assert lossy.generate("one two three", max_new_tokens=8).stats.lossy  # the API's stats say so


def test_cli_says_the_fallback_in_one_line_and_labels_lossy(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    monkeypatch.setattr(probe_mod, "probe", lambda backend, manifest, cand, depth: _failing(cand))
    args = ["generate", str(tiny_bundle), "--prompt", PROMPTS[1], "--max-new-tokens", "12", "--draft", "prompt-lookup"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    warning = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "plain decoding only" in warning[0] and "Traceback" not in res.output
    assert "LOSSY" not in res.stderr
    res = CliRunner().invoke(main, [*args, "--allow-inexact"])
    assert res.exit_code == 0, res.output
    assert "[LOSSY: inexact speculation, --allow-inexact]" in res.stderr


def test_verdicts_are_cached_per_machine(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    calls = []
    real = probe_mod.probe

    def counting(*args):
        calls.append(args[2].name)
        return real(*args)

    monkeypatch.setattr(probe_mod, "probe", counting)
    looked_up = []  # every candidate resolve_plan asks a verdict of, cached or probed
    key = probe_mod.verdict_key
    monkeypatch.setattr(probe_mod, "verdict_key", lambda b, m, c, d: looked_up.append(c.name) or key(b, m, c, d))
    with load(tiny_bundle, draft=None) as engine:
        first = engine.plan
        assert calls and (tmp_path / "exactness.json").is_file()
        n = len(calls)
        again = resolve_plan(engine.backend, engine.manifest)
        assert len(calls) == n and again.candidate == first.candidate and again.exact == first.exact
        if first.exact:  # the plan line says which step time it quotes: measured now, or the first probe's
            assert "per plain step now)" in first.reason and "per plain step when first probed)" in again.reason
        # What the backend can still run: at load the engine frees the graphs its plan does not use (release_unused:
        # the 1-row graph without a split plan, the gathered one without a gathered plan), and with them their
        # candidates. Which plan a CPU picks (and so which graphs stay) is the probe's verdict there.
        runnable = [c.name for c in candidates(engine.backend, probe_depth(engine.manifest.limits.max_tree))]
        assert first.candidate.name in runnable
        monkeypatch.setattr(verdict_cache, "machine_id", lambda: "another CPU | x86_64 | 000")
        del looked_up[:]
        resolve_plan(engine.backend, engine.manifest)
        # another machine: no verdict of this one's is reused, so each candidate asked about is probed again, and
        # those are the ones the backend can still run, in their order, from the first (a cache not keyed per
        # machine would probe none)
        assert calls[n:] == looked_up and looked_up[0] == runnable[0], (calls, looked_up, runnable)
        assert [c for c in runnable if c in looked_up] == looked_up, (looked_up, runnable)
    n = len(calls)
    (tmp_path / "exactness.json").write_text("{not json")  # a corrupt cache is ignored: the load probes afresh
    with load(tiny_bundle, draft=None) as engine:
        got = engine.plan
        assert len(calls) > n
        # the plan its verdicts allow, and those verdicts are the first probe's (timings decide between exact plans
        # near a cost limit, so the choice itself may differ from the first load's)
        mine = choose(list(got.probes), probe_depth(engine.manifest.limits.max_tree))
        assert (got.candidate, got.exact, got.trees) == (mine.candidate, mine.exact, mine.trees)
        verdicts = {r.candidate: (r.chains_exact, r.trees_exact) for r in first.probes}
        assert all(verdicts[r.candidate] == (r.chains_exact, r.trees_exact) for r in got.probes
                   if r.candidate in verdicts)


def test_choose_orders_and_explains():
    one, two = Candidate("one-graph", False, 1), Candidate("two-rows", False, 2)
    ok = ProbeResult(two, (ProbeCheck("chain T=2", 0.0), ProbeCheck("tree", 3e-5)), 2.0)
    picked = choose([_failing(one), ok], 16)
    assert picked.candidate == two and picked.exact and not picked.trees and picked.speculate
    assert "'one-graph' differs by 0.25 at chain T=2" in picked.reason
    assert choose([ProbeResult(one, (ProbeCheck("chain T=2", 0.0), ProbeCheck("tree", 0.0)), 1.0)], 16).trees


def test_choose_takes_the_padded_plan_only_at_a_plain_step_cost():
    one, two, pad = Candidate("one-graph", False, 1), Candidate("two-rows", False, 2), Candidate("padded-16", False, 16)
    exact = (ProbeCheck("chain T=2", 0.0), ProbeCheck("tree", 1e-3))
    cheap = choose([_failing(one), _failing(two), ProbeResult(pad, exact, 1.2)], 16)  # a GPU: 16 rows ~ 1 row
    assert cheap.candidate == pad and cheap.exact and cheap.speculate and not cheap.trees and cheap.min_rows == 16
    dear = choose([_failing(one), _failing(two), ProbeResult(pad, exact, 3.5)], 16)  # a CPU: 16 rows ~ 3.5 rows
    assert not dear.speculate and "plain decoding only" in dear.reason
    assert "'padded-16' is exact but its plain step costs 3.5x the fastest" in dear.reason
    assert choose([ProbeResult(one, exact, 1.0), ProbeResult(pad, exact, 1.0)], 16).candidate == one


class RowCountSkew(OneRowSkew):
    """Logits one ulp off in every step of fewer than ``rows`` rows, as kernels chosen by row count are:
    only a plan whose steps all run the same rows keeps speculative rows equal to plain rows."""

    rows = 16

    def step(self, inputs, cache):
        out = self.inner.step(inputs, cache)
        n = inputs.input_ids.shape[1]
        if n < self.rows:
            bump = np.float32(np.inf) if n % 2 else np.float32(-np.inf)
            return StepOutputs(np.nextafter(out.logits, bump), out.hidden_states)
        return out


def test_padded_plan_is_exact_where_kernels_change_with_the_row_count(tiny_bundle):
    with load(tiny_bundle, draft=None) as engine:
        skew = RowCountSkew(engine.backend)
        chosen = resolve_plan(skew, engine.manifest, use_cache=False)
        names = [r.candidate.name for r in chosen.probes]
        assert names[:2] == ["one-graph", "two-rows"] and not any(r.chains_exact for r in chosen.probes[:2])
        pad = chosen.probes[-1]
        assert pad.candidate.name == "padded-16" and pad.chains_exact
        # the tiny model on the CPU: 16 rows cost more than PADDED_MAX_COST plain steps or not; either way
        # the plan says which, and greedy speculation on the padded plan equals plain decoding on it
        assert chosen.candidate == pad.candidate or "'padded-16' is exact but" in chosen.reason
        forced = plan.StepPlan(pad.candidate, True, True, False, 16, "forced")
        for stats in _speculative_equals_plain(engine, skew, forced):
            assert stats.steps < 31  # it did speculate


class LongContextSkew(OneRowSkew):
    """A 1-row step is one ulp off only past ``past`` committed slots, as a kernel that switches with the
    key length is: the short context alone would pass it."""

    past = 100

    def step(self, inputs, cache):
        out = self.inner.step(inputs, cache)
        if inputs.input_ids.shape[1] == 1 and cache.length > self.past:
            return StepOutputs(np.nextafter(out.logits, np.float32(np.inf)), out.hidden_states)
        return out


def test_probe_checks_a_second_longer_context(tiny_bundle):
    with load(tiny_bundle, draft=None) as engine:
        assert engine.manifest.limits.max_context >= plan.PROBE_LONG + 18
        res = probe(LongContextSkew(engine.backend), engine.manifest, Candidate("one-graph", False, 1), depth=6)
        last = res.checks[-1]
        assert not res.chains_exact and last.what == f"chain T=2 @{plan.PROBE_LONG}" and 0 < last.max_abs < 1e-3
        assert [c.what for c in res.checks][:6] == [f"chain T={t}" for t in range(2, 7)] + ["tree"]


def test_a_tree_padded_to_the_plan_keeps_its_parents(tiny_bundle):
    """A padded plan adds dummy nodes under the last node: a branching tree keeps its own mask."""
    from specdeploy.runtime.decode import Decoder
    from specdeploy.runtime.tree import DraftTree

    with load(tiny_bundle, draft=None) as engine:
        dec = Decoder(engine.backend, engine.manifest, None,
                      plan=plan.StepPlan(Candidate("padded-8", False, 8), True, True, True, 8, "forced"))
        state, _ = dec.prefill(engine.encode(PROMPTS[1]))
        masks = []
        step = engine.backend.step
        engine.backend.step = lambda inputs, cache: masks.append(inputs.attention_mask) or step(inputs, cache)
        try:
            out = dec.verify(state, DraftTree(np.array([5, 6, 7]), np.array([-1, 0, 0])),
                             DraftTree(np.array([5, 6, 7]), np.array([-1, 0, 0])).buffers())
        finally:
            engine.backend.step = step
        [m] = masks
        p = state.cache.length
        seen = m[0, 0, :, p : p + 8] == 0
        assert seen.shape == (8, 8) and out.logits.shape[1] == 3
        assert seen[2].tolist() == [True, False, True] + [False] * 5  # node 2's parent is the root, not node 1
        assert seen[3].tolist() == [True, False, True, True] + [False] * 4  # the dummies hang under node 2
