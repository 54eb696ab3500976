"""The step plan: how every step of a loaded bundle runs, resolved once at load by a measured probe.

Greedy speculative decoding is lossless only if the base computes a verified node's row bitwise as a
plain step computes the same token at the same position. Whether it does depends on the kernels ONNX
Runtime (or another backend) picks, which depend on the CPU's instruction set, the runtime's version
and the graph: measured here, a 1-row int4 step equals row 0 of a 2-row step on an AVX-512 VNNI Xeon
and differs by up to 0.49 in the logits on an AVX2 EPYC. So nothing is assumed. For each candidate
plan, from the fastest plain step to the slowest, the probe (:mod:`.probe`) runs plain steps and chain steps of
every length the plan allows (and one tree) through the real :class:`~.decode.Decoder` and backend,
and compares logits, hidden states and K/V bit for bit. The first candidate whose chains agree is the
plan; trees are allowed only if the tree agrees too. The candidates and the choice among them are
:mod:`.plan_choice`; the verdict is cached per (CPU model and flags as :mod:`.machine` reads them, ONNX Runtime
version, threads, backend, graph hashes) in the user cache (:mod:`.verdicts`).

This module holds the plan's types: a :class:`Candidate` (a way to run steps), a :class:`ProbeResult` (the
probe's :class:`ProbeCheck` comparisons on one candidate) and the :class:`StepPlan` the Decoder and the backend
read. The probe checks each candidate at two contexts, :data:`PROBE_PROMPT` tokens and :data:`PROBE_LONG`
(kernels may switch with the key length: on the H200 a bf16 plan exact at the short context alone let
one of four 128-token generations leave plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_DEPTH = 16  # longest chain the probe checks, so the longest step an exact plan runs
PROBE_PROMPT = 12  # tokens of context before the probed steps
PROBE_LONG = 200  # the second context the chains are checked at (a later capacity bucket)
ROWS_CHECK = "batch"  # the probe's checks of a sequence's rows among other sequences' (ProbeCheck.what)
LONE = "lone"  # step_plan: the fastest exact plan for one sequence at a time, whether or not its rows batch


@dataclass(frozen=True)
class Candidate:
    """A way to run steps: ``split`` routes 1-row steps to the backend's 1-row graph; ``min_rows`` pads;
    ``gathered`` runs every step in the backend's gathered form (each row's keys in plain-step order)."""

    name: str
    split: bool
    min_rows: int
    gathered: bool = False

    @property
    def padded(self) -> bool:
        """Every step pads to more rows than a dummy row's two: plain steps pay for them (``padded-N``)."""
        return self.min_rows > 2


@dataclass(frozen=True)
class ProbeCheck:
    """One bitwise comparison: the largest |difference| over logits, hidden states and K/V rows."""

    what: str  # "chain T=3", "tree", "tree @200"
    max_abs: float

    @property
    def passed(self) -> bool:
        return self.max_abs == 0.0


@dataclass(frozen=True)
class ProbeResult:
    candidate: Candidate
    checks: tuple[ProbeCheck, ...]
    plain_ms: float  # median time of the probe's plain steps on this candidate
    cached: bool = False  # read from the verdict cache: plain_ms is the probe's, from an earlier load

    @property
    def chains_exact(self) -> bool:
        return all(c.passed for c in self.checks if not c.what.startswith(("tree", ROWS_CHECK)))

    @property
    def trees_exact(self) -> bool:
        return self.chains_exact and all(c.passed for c in self.checks if not c.what.startswith(ROWS_CHECK))

    @property
    def rows_exact(self) -> bool:
        """Rows of several sequences share a step bit for bit as each computes alone (checked on the gathered
        plans only: :func:`.probe.probe_rows`): one answer at any load."""
        return self.trees_exact and any(c.what.startswith(ROWS_CHECK) for c in self.checks) and all(
            c.passed for c in self.checks)

    def worst(self) -> ProbeCheck:
        return max(self.checks, key=lambda c: c.max_abs)


@dataclass(frozen=True)
class StepPlan:
    """Resolved once per loaded bundle; the Decoder and the backend read it, nothing else decides."""

    candidate: Candidate
    speculate: bool  # drafts are verified; False: plain decoding only (no exact speculative plan here)
    exact: bool  # the probe found every speculative row bitwise equal to the plain row
    trees: bool  # drafts may branch; else each is cut to its best chain
    max_rows: int  # the longest step a speculative step may run (the probe's depth for exact plans)
    reason: str  # one line: which plan and why
    probes: tuple[ProbeResult, ...] = ()
    rows: bool = False  # several sequences' rows share a step exactly (ProbeResult.rows_exact): batching is exact

    @property
    def lossy(self) -> bool:
        """Speculation whose greedy output may differ from plain decoding (only with allow_inexact)."""
        return self.speculate and not self.exact

    @property
    def min_rows(self) -> int:
        return self.candidate.min_rows

    @property
    def split(self) -> bool:
        return self.candidate.split


__all__ = ["LONE", "PROBE_DEPTH", "PROBE_LONG", "PROBE_PROMPT", "ROWS_CHECK", "Candidate", "ProbeCheck", "ProbeResult",
           "StepPlan"]
