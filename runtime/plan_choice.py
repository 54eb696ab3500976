"""Which step plan: the candidates a backend can run, and the choice among the probe's results (:mod:`.plan`).

Candidates (:func:`candidates`), fastest plain step first:

- ``split``: on a bundle with a GGUF-block graph, 1-row steps run it and steps of more rows the other
  graph. The fastest plain step, but two graphs' arithmetic: exact only if the probe says so.
- ``one-graph``: every step on the multi-row graph, 1-row plain steps.
- ``two-rows``: every step on the multi-row graph with at least two rows (a plain step carries a
  dummy row whose output is dropped): for kernels whose 1-row path differs from their multi-row path.
- ``padded-N``: every step, plain ones included, runs exactly N rows (N the probe depth), so the
  kernels see one shape per capacity bucket in plain and speculative decoding alike: exact by
  construction wherever a row's arithmetic does not depend on the other rows' values, as with the
  row-count-dependent GEMM and attention kernels of cuBLAS and cuDNN (on an H200 in fp32, fp16 and
  bf16 the 1-row and 2-row plans differ and this one is exact). It is taken only where its plain step
  costs at most :data:`PADDED_MAX_COST` times the fastest candidate's (a GPU, where 16 rows cost about
  one; not a CPU, where they cost 3-4), since every plain step pays for the N rows.
- ``gathered``, ``gathered-two-rows``, ``gathered-padded-N``: the same on the backend's gathered form (each
  row's keys in plain-step order), where it has one: trees exact by construction.

If none is exact, the plan decodes plainly (``speculate`` False) with the fastest plain step and says
why in one sentence; ``allow_inexact`` runs speculation there anyway, labelled lossy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .plan import PROBE_DEPTH, Candidate, ProbeResult, StepPlan

if TYPE_CHECKING:
    from .backends.base import Backend

PADDED_MAX_COST = 1.5  # the padded plan's plain step against the fastest candidate's, at most
GATHERED_MAX_COST = 1.15  # an exact-tree plan's plain step against the chain plan's, at most (rows not invariant)


def probe_depth(max_tree: int) -> int:
    """The rows the probe checks (so the longest step an exact plan runs): the bundle's tree limit, 2 to
    :data:`PROBE_DEPTH`."""
    return max(2, min(PROBE_DEPTH, max_tree))


def candidates(backend: Backend, depth: int = PROBE_DEPTH) -> list[Candidate]:
    """The plans this backend can run, fastest plain step first; ``depth`` rows for the padded ones; the
    gathered plans (exact trees) last, where the backend has the gathered form."""
    out = [Candidate("split", True, 1)] if backend.can_split else []
    out += [Candidate("one-graph", False, 1), Candidate("two-rows", False, 2)]
    out += [Candidate(f"padded-{depth}", False, depth)] if depth > 2 else []
    if backend.can_gather:
        out += [Candidate("gathered", False, 1, True), Candidate("gathered-two-rows", False, 2, True)]
        out += [Candidate(f"gathered-padded-{depth}", False, depth, True)] if depth > 2 else []
    return out


def choose(results: list[ProbeResult], depth: int, allow_inexact: bool = False, rows_first: bool = True) -> StepPlan:
    """The plan the probe results allow. A gathered candidate whose rows are invariant (``rows_exact``: a
    sequence's rows computed alike alone, among other sequences, beside its own draft rows and padding) comes
    first: one answer at any load, from ``generate`` to a full batch, at the plain-step cost it states against
    the fastest candidate's (the exactness tax). Else the first exact candidate in the order probed, except
    that a gathered candidate whose trees are exact comes first where the chosen one's trees differ and its
    plain step costs at most :data:`GATHERED_MAX_COST` times that one's (every plain step pays for the
    gathering). ``rows_first`` False (``step_plan`` :data:`LONE`) leaves the invariant plan its place in that order:
    the exactness tax's baseline."""
    fastest_ms = min(r.plain_ms for r in results)
    too_slow = [r for r in results if r.chains_exact and r.candidate.padded
                and r.plain_ms > PADDED_MAX_COST * fastest_ms]
    failed = [r for r in results if not r.chains_exact]
    usable = [r for r in results if r.chains_exact and r not in too_slow]
    invariant = next((r for r in usable if r.rows_exact), None) if rows_first else None
    if invariant is not None:
        when = " when first probed" if invariant.cached else " now"
        tax = invariant.plain_ms / fastest_ms
        return _exact(invariant, depth, tuple(results), when=when,
                      tax=f", {tax:.2f}x the fastest plan's plain step (the exactness tax)" if tax > 1 else "")
    first = next((r for r in usable if not r.candidate.gathered), None)
    trees = next((r for r in usable if r.candidate.gathered and r.trees_exact), None)
    if trees is not None and trees.plain_ms > GATHERED_MAX_COST * (fastest_ms if first is None else first.plain_ms):
        too_slow.append(trees)
        usable.remove(trees)
        trees = None
    why_not = "; ".join([f"'{r.candidate.name}' differs by {r.worst().max_abs:.2g} at {r.worst().what}"
                         for r in failed] + [f"'{r.candidate.name}' is exact but its plain step costs "
                                             f"{r.plain_ms / fastest_ms:.1f}x the fastest" for r in too_slow])
    if first is not None and (first.trees_exact or trees is None):
        pick = first
    else:  # the exact-tree plan, or where no other is exact, the first usable one
        pick = trees or next(iter(usable), None)
    if pick is not None:
        when = " when first probed" if pick.cached else " now"
        return _exact(pick, depth, tuple(results), when=when, skipped=f" ({why_not})" if why_not else "")
    fastest = results[0]
    if allow_inexact:
        reason = (f"LOSSY speculation (--allow-inexact): no step plan is exact on this machine ({why_not}); "
                  f"greedy output may differ from plain decoding.")
        return StepPlan(fastest.candidate, True, False, True, 1 << 30, reason, tuple(results))
    cost = "at a plain step's cost " if too_slow else ""
    reason = (f"plain decoding only: no step plan gives speculative rows bitwise equal to plain rows {cost}on this "
              f"machine ({why_not}); pass --allow-inexact to speculate anyway, labelled lossy.")
    return StepPlan(fastest.candidate, False, False, False, 1, reason, tuple(results))


def _exact(res: ProbeResult, depth: int, results: tuple[ProbeResult, ...], asked: str = "", when: str = "",
           skipped: str = "", tax: str = "") -> StepPlan:
    """The exact plan on ``res``'s candidate, with the sentence that says why."""
    shape = "trees" if res.trees_exact else "chains (a tree's rows differ)"
    if res.rows_exact:
        shape += ", and rows of several sequences in one step (one answer at any load)"
    reason = (f"exact speculation: step plan '{res.candidate.name}'{asked} ({res.plain_ms:.1f} ms per plain step"
              f"{when}){tax}, {shape}, probed bit for bit on this machine{skipped}.")
    return StepPlan(res.candidate, True, True, res.trees_exact, depth, reason, results, rows=res.rows_exact)


def asked_for(res: ProbeResult, depth: int, allow_inexact: bool = False) -> StepPlan:
    """The plan a caller named (``step_plan``), where the probe finds it exact; with ``allow_inexact`` it
    speculates there anyway, labelled lossy; else :class:`StepPlanError`."""
    from .errors import StepPlanError

    name, worst = res.candidate.name, res.worst()
    if res.chains_exact:
        return _exact(res, depth, (res,), asked=" as asked")
    if allow_inexact:
        reason = (f"LOSSY speculation (--allow-inexact): step plan '{name}' as asked differs by {worst.max_abs:.2g} "
                  f"at {worst.what} on this machine; greedy output may differ from plain decoding.")
        return StepPlan(res.candidate, True, False, True, 1 << 30, reason, (res,))
    raise StepPlanError(f"The '{name}' step plan is not exact on this machine (a speculative row differs from the "
                        f"plain row by {worst.max_abs:.2g} at {worst.what}); leave the plan to the probe, or pass "
                        f"--allow-inexact to speculate on it labelled lossy.")


__all__ = ["GATHERED_MAX_COST", "PADDED_MAX_COST", "asked_for", "candidates", "choose", "probe_depth"]
