"""The step plan: how every step of a loaded bundle runs, resolved once at load by a measured probe.

Greedy speculative decoding is lossless only if the base computes a verified node's row bitwise as a
plain step computes the same token at the same position. Whether it does depends on the kernels ONNX
Runtime (or another backend) picks, which depend on the CPU's instruction set, the runtime's version
and the graph: measured here, a 1-row int4 step equals row 0 of a 2-row step on an AVX-512 VNNI Xeon
and differs by up to 0.49 in the logits on an AVX2 EPYC. So nothing is assumed. For each candidate
plan, from the fastest plain step to the slowest, :func:`probe` runs plain steps and chain steps of
every length the plan allows (and one tree) through the real :class:`~.decode.Decoder` and backend,
and compares logits, hidden states and K/V bit for bit. The first candidate whose chains agree is the
plan; trees are allowed only if the tree agrees too (the probe itself is :mod:`.probe`). The verdict is cached per (CPU model and flags,
ONNX Runtime version, threads, backend, graph hashes) in the user cache (:func:`cache_dir`).

Candidates (:func:`candidates`):

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

The probe checks each candidate at two contexts, :data:`PROBE_PROMPT` tokens and :data:`PROBE_LONG`
(kernels may switch with the key length: on the H200 a bf16 plan exact at the short context alone let
one of four 128-token generations leave plain decoding).

If none is exact, the plan decodes plainly (``speculate`` False) with the fastest plain step and says
why in one sentence; ``allow_inexact`` runs speculation there anyway, labelled lossy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backends.base import Backend
    from .bundle import BundleManifest

PROBE_VERSION = 4
PROBE_DEPTH = 16  # longest chain the probe checks, so the longest step an exact plan runs
PROBE_PROMPT = 12  # tokens of context before the probed steps
PROBE_LONG = 200  # the second context the chains are checked at (a later capacity bucket)
PADDED_MAX_COST = 1.5  # the padded plan's plain step against the fastest candidate's, at most
GATHERED_MAX_COST = 1.15  # an exact-tree plan's plain step against the chain plan's, at most (rows not invariant)
ROWS_CHECK = "batch"  # the probe's checks of a sequence's rows among other sequences' (ProbeCheck.what)


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


# --- choosing and the verdict cache --------------------------------------------------------------
LONE = "lone"  # step_plan: the fastest exact plan for one sequence at a time, whether or not its rows batch


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


def cache_dir() -> Path:
    """``$SPECDEPLOY_CACHE``, else ``$XDG_CACHE_HOME/specdeploy``, else ``~/.cache/specdeploy``."""
    env = os.environ.get("SPECDEPLOY_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdeploy"


ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_bf16", "asimddp", "sve")
# /proc/cpuinfo names of the flags numpy also detects, by CPUID, in this very process
_NUMPY_NAMES = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512_vnni": "AVX512VNNI", "avx512_bf16": "AVX512BF16",
                "asimddp": "ASIMDDP", "sve": "SVE"}


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (``/proc/cpuinfo``; empty where it is not readable)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def process_features() -> frozenset[str] | None:
    """The instruction sets this process's CPUID reports, as numpy detected them at import; None if unknown.

    Usually what /proc/cpuinfo says; not under an emulator (``qemu-x86_64 -cpu EPYC-Rome``, whose guest
    sees AVX2 only while /proc/cpuinfo shows the host's AVX-512) or a hypervisor that masks features.
    ONNX Runtime picks its kernels by CPUID, so this is the view that decides them."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as feats  # numpy >= 2
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as feats  # numpy 1.x
        except ImportError:
            return None
    return frozenset(k for k, on in feats.items() if on)


def cpu_isa() -> str:
    """The kernel-relevant instruction sets, e.g. ``avx2`` or ``avx2 avx512f avx512_vnni``, to print beside figures.

    Flags /proc/cpuinfo lists but this process's CPUID lacks are left out; where the two views disagree,
    the flags numpy cannot check (AVX-VNNI, AMX) are left out too and the text says so."""
    flags, seen = cpu_flags(), process_features()
    if seen is None or not flags:
        return " ".join(f for f in ISA_FLAGS if f in flags) or "unknown"
    masked = {f for f, name in _NUMPY_NAMES.items() if f in flags and name not in seen}
    keep = [f for f in ISA_FLAGS if f in flags and f not in masked and (f in _NUMPY_NAMES or not masked)]
    note = f" (CPUID lacks {' '.join(sorted(masked))} of /proc/cpuinfo: emulated or masked)" if masked else ""
    return (" ".join(keep) or "unknown") + note


def machine_id() -> str:
    """The CPU model and instruction-set flags, which decide the kernels ONNX Runtime picks."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), model)
    except OSError:
        pass
    seen = process_features()
    flags = " ".join(sorted(cpu_flags())) + " | cpuid: " + (" ".join(sorted(seen)) if seen is not None else "?")
    return f"{model} | {platform.machine()} | {cpu_isa()} | {hashlib.sha1(flags.encode()).hexdigest()[:12]}"


def verdict_key(backend: Backend, manifest: BundleManifest, cand: Candidate, depth: int) -> str:
    graphs = ",".join(g.sha for g in backend.graphs(cand.split, cand.gathered))
    rows = "/rows" if cand.gathered and backend.can_batch_rows else ""  # the verdict holds the rows checks
    parts = (f"v{PROBE_VERSION}", machine_id(), backend.runtime_version(), backend.name, f"threads={backend.threads}",
             graphs, f"{cand.name}/{cand.min_rows}{rows}", f"depth={depth}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def _verdict_file() -> Path:
    return cache_dir() / "exactness.json"


def _read_verdicts() -> dict:
    try:
        return json.loads(_verdict_file().read_text())
    except (OSError, ValueError):
        return {}


def cached_verdict(key: str) -> ProbeResult | None:
    raw = _read_verdicts().get(key)
    if not isinstance(raw, dict):
        return None
    try:
        cand = Candidate(**raw["candidate"])
        checks = tuple(ProbeCheck(c["what"], float(c["max_abs"])) for c in raw["checks"])
        return ProbeResult(cand, checks, float(raw["plain_ms"]), cached=True)
    except (KeyError, TypeError, ValueError):
        return None


def store_verdict(key: str, res: ProbeResult) -> None:
    """Best effort: an unwritable cache only means the probe runs again next time."""
    try:
        path = _verdict_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        verdicts = _read_verdicts()
        raw = dataclasses.asdict(res)
        raw.pop("cached", None)
        raw["machine"] = machine_id()
        verdicts[key] = raw
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdicts, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


__all__ = ["Candidate", "ProbeCheck", "ProbeResult", "StepPlan", "asked_for", "cache_dir", "cached_verdict", "candidates",
           "choose", "cpu_isa", "machine_id", "probe_depth", "process_features", "store_verdict", "verdict_key"]
