"""The step plan: how every step of a loaded bundle runs, resolved once at load by a measured probe.

Greedy speculative decoding is lossless only if the base computes a verified node's row bitwise as a
plain step computes the same token at the same position. Whether it does depends on the kernels ONNX
Runtime (or another backend) picks, which depend on the CPU's instruction set, the runtime's version
and the graph: measured here, a 1-row int4 step equals row 0 of a 2-row step on an AVX-512 VNNI Xeon
and differs by up to 0.49 in the logits on an AVX2 EPYC. So nothing is assumed. For each candidate
plan, from the fastest plain step to the slowest, :func:`probe` runs plain steps and chain steps of
every length the plan allows (and one tree) through the real :class:`~.decode.Decoder` and backend,
and compares logits, hidden states and K/V bit for bit. The first candidate whose chains agree is the
plan; trees are allowed only if the tree agrees too. The verdict is cached per (CPU model and flags,
ONNX Runtime version, threads, backend, graph hashes) in the user cache (:func:`cache_dir`).

Candidates (:func:`candidates`):

- ``split``: on a bundle with a GGUF-block graph, 1-row steps run it and steps of more rows the other
  graph. The fastest plain step, but two graphs' arithmetic: exact only if the probe says so.
- ``one-graph``: every step on the multi-row graph, 1-row plain steps.
- ``two-rows``: every step on the multi-row graph with at least two rows (a plain step carries a
  dummy row whose output is dropped): for kernels whose 1-row path differs from their multi-row path.

If none is exact, the plan decodes plainly (``speculate`` False) with the fastest plain step and says
why in one sentence; ``allow_inexact`` runs speculation there anyway, labelled lossy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .backends.base import Backend
    from .bundle import BundleManifest

PROBE_VERSION = 1
PROBE_DEPTH = 16  # longest chain the probe checks, so the longest step an exact plan runs
PROBE_PROMPT = 12  # tokens of context before the probed steps


@dataclass(frozen=True)
class Candidate:
    """A way to run steps: ``split`` routes 1-row steps to the backend's 1-row graph; ``min_rows`` pads."""

    name: str
    split: bool
    min_rows: int


@dataclass(frozen=True)
class ProbeCheck:
    """One bitwise comparison: the largest |difference| over logits, hidden states and K/V rows."""

    what: str  # "chain T=3", "tree"
    max_abs: float

    @property
    def passed(self) -> bool:
        return self.max_abs == 0.0


@dataclass(frozen=True)
class ProbeResult:
    candidate: Candidate
    checks: tuple[ProbeCheck, ...]
    plain_ms: float  # median time of the probe's plain steps on this candidate

    @property
    def chains_exact(self) -> bool:
        return all(c.passed for c in self.checks if c.what != "tree")

    @property
    def trees_exact(self) -> bool:
        return self.chains_exact and all(c.passed for c in self.checks)

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


def candidates(backend: Backend) -> list[Candidate]:
    """The plans this backend can run, fastest plain step first."""
    out = [Candidate("split", True, 1)] if backend.can_split else []
    return out + [Candidate("one-graph", False, 1), Candidate("two-rows", False, 2)]


# --- the probe ------------------------------------------------------------------------------------
def probe(backend: Backend, manifest: BundleManifest, cand: Candidate, depth: int) -> ProbeResult:
    """Plain steps against chain steps of every length 2..``depth`` and one tree, bit for bit.

    From one prefilled context, plain steps feed tokens ``t_0..t_{depth-1}`` one at a time
    (teacher-forced, the way plain decoding would emit them); from the same context, a chain step of
    each length T must give every row's logits, hidden state and K/V exactly as the plain steps did. The tree ``[t_0, z, t_1, t_2]`` (``z`` a sibling of ``t_1``) puts ``t_1`` and ``t_2`` at cache
    slots whose ancestors are not adjacent, as a branching draft does.
    """
    from .decode import Decoder
    from .tree import DraftTree

    dec = Decoder(backend, manifest, None, plan=_probe_plan(cand, depth))
    v = manifest.model.vocab_size
    prompt = [(17 + 7919 * i) % v for i in range(PROBE_PROMPT)]
    tokens = [(101 + 104729 * i) % v for i in range(depth + 1)]
    backend.use_split(cand.split)
    try:
        state, _ = dec.prefill(prompt)
        cache, p = state.cache, state.cache.length
        cache.ensure_capacity(p + depth + 2, dec.buckets)

        def run(tree: DraftTree, start: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
            cache.length, n = start, len(tree.tokens)
            out = dec.verify(state, tree, tree.buffers())
            kv = [_host(b[:, :, start : start + n]) for b in cache.buffers()]  # the rows this step wrote
            return out.logits[0, :n], out.hidden_states[0, :n], kv

        def plain_step(i: int) -> None:
            t0 = time.perf_counter()
            lg, hd, kv = run(DraftTree.root(tokens[i]), p + i)
            times.append(time.perf_counter() - t0)
            plain_logits.append(lg[0])
            plain_hidden.append(hd[0])
            plain_kv.append([k[:, :, 0] for k in kv])

        # Plain steps are taken as the chains need them: plain step i reads slots p..p+i-1, which the
        # chain of length i (checked just before) wrote bit for bit as plain steps would have, so a
        # failing candidate costs a few steps, not the whole depth.
        times, plain_logits, plain_hidden, plain_kv = [], [], [], []
        plain_step(0)
        checks = []
        for t in range(2, depth + 1):
            plain_step(t - 1)
            lg, hd, kv = run(DraftTree(np.asarray(tokens[:t]), np.arange(-1, t - 1)), p)
            gap = max(_gap(lg, np.stack(plain_logits[:t])), _gap(hd, np.stack(plain_hidden[:t])),
                      max(_gap(kv[j], np.stack([plain_kv[i][j] for i in range(t)], axis=2))
                          for j in range(len(kv))))
            checks.append(ProbeCheck(f"chain T={t}", gap))
            if gap:  # the candidate fails: the rest would not change the verdict
                break
        if depth >= 3 and not checks[-1].max_abs:
            tree = DraftTree(np.asarray([tokens[0], tokens[depth], tokens[1], tokens[2]]), np.array([-1, 0, 0, 2]))
            lg, hd, kv = run(tree, p)
            keep = [0, 2, 3]  # the nodes on the path t_0 -> t_1 -> t_2
            gap = max(_gap(lg[keep], np.stack(plain_logits[:3])), _gap(hd[keep], np.stack(plain_hidden[:3])),
                      max(_gap(kv[j][:, :, keep], np.stack([plain_kv[i][j] for i in range(3)], axis=2))
                          for j in range(len(kv))))
            checks.append(ProbeCheck("tree", gap))
        return ProbeResult(cand, tuple(checks), 1000 * float(np.median(times)))
    finally:
        backend.use_split(True)


def _host(x) -> np.ndarray:
    """A host copy of a cache buffer (numpy here; a torch tensor on the torch backend)."""
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy().copy()
    return np.array(x, copy=True)


def _gap(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return float("inf")
    if np.array_equal(a, b):  # bitwise, NaN-free fast path
        return 0.0
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(d.max()) if np.isfinite(d).all() else float("inf")


def _probe_plan(cand: Candidate, depth: int) -> StepPlan:
    return StepPlan(cand, speculate=True, exact=False, trees=True, max_rows=max(depth, 4), reason="probing")


# --- resolution and the verdict cache -----------------------------------------------------------------
def resolve_plan(backend: Backend, manifest: BundleManifest, allow_inexact: bool = False, use_cache: bool = True,
                 progress: Callable[[str], None] | None = None) -> StepPlan:
    """Probe the candidates in order (cached per machine) and return the fastest exact plan.

    No exact candidate: plain decoding with the fastest candidate, or with ``allow_inexact`` speculation
    there, labelled lossy. The probe depth is the bundle's tree limit, at most :data:`PROBE_DEPTH`.
    """
    depth = max(2, min(PROBE_DEPTH, manifest.limits.max_tree))
    results: list[ProbeResult] = []
    for cand in candidates(backend):
        key = verdict_key(backend, manifest, cand, depth)
        res = _cached(key) if use_cache else None
        if res is None:
            if progress is not None:
                progress(f"probing exactness of the '{cand.name}' step plan on this machine ...")
            res = probe(backend, manifest, cand, depth)
            if use_cache:
                _store(key, res)
        results.append(res)
        if res.chains_exact:
            break
    return choose(results, depth, allow_inexact)


def choose(results: list[ProbeResult], depth: int, allow_inexact: bool = False) -> StepPlan:
    """The plan the probe results allow (the first exact candidate, in the order probed)."""
    failed = [r for r in results if not r.chains_exact]
    why_not = "; ".join(f"'{r.candidate.name}' differs by {r.worst().max_abs:.2g} at {r.worst().what}"
                        for r in failed)
    for res in results:
        if res.chains_exact:
            shape = "trees" if res.trees_exact else "chains (a tree's rows differ)"
            skipped = f" ({why_not})" if failed else ""
            reason = (f"exact speculation: step plan '{res.candidate.name}' ({res.plain_ms:.1f} ms per plain step), "
                      f"{shape}, probed bit for bit on this machine{skipped}.")
            return StepPlan(res.candidate, True, True, res.trees_exact, depth, reason, tuple(results))
    fastest = results[0]
    if allow_inexact:
        reason = (f"LOSSY speculation (--allow-inexact): no step plan is exact on this machine ({why_not}); "
                  f"greedy output may differ from plain decoding.")
        return StepPlan(fastest.candidate, True, False, True, 1 << 30, reason, tuple(results))
    reason = (f"plain decoding only: no step plan gives speculative rows bitwise equal to plain rows on this "
              f"machine ({why_not}); pass --allow-inexact to speculate anyway, labelled lossy.")
    return StepPlan(fastest.candidate, False, False, False, 1, reason, tuple(results))


def cache_dir() -> Path:
    """``$SPECDEPLOY_CACHE``, else ``$XDG_CACHE_HOME/specdeploy``, else ``~/.cache/specdeploy``."""
    env = os.environ.get("SPECDEPLOY_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdeploy"


ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_bf16", "asimddp", "sve")


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


def cpu_isa() -> str:
    """The kernel-relevant instruction sets, e.g. ``avx2`` or ``avx2 avx512f avx512_vnni``, to print beside figures."""
    return " ".join(f for f in ISA_FLAGS if f in cpu_flags()) or "unknown"


def machine_id() -> str:
    """The CPU model and instruction-set flags, which decide the kernels ONNX Runtime picks."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), model)
    except OSError:
        pass
    flags = " ".join(sorted(cpu_flags()))
    return f"{model} | {platform.machine()} | {cpu_isa()} | {hashlib.sha1(flags.encode()).hexdigest()[:12]}"


def verdict_key(backend: Backend, manifest: BundleManifest, cand: Candidate, depth: int) -> str:
    graphs = ",".join(g.sha for g in backend.graphs(cand.split))
    parts = (f"v{PROBE_VERSION}", machine_id(), backend.runtime_version(), backend.name, f"threads={backend.threads}",
             graphs, f"{cand.name}/{cand.min_rows}", f"depth={depth}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def _verdict_file() -> Path:
    return cache_dir() / "exactness.json"


def _read_verdicts() -> dict:
    try:
        return json.loads(_verdict_file().read_text())
    except (OSError, ValueError):
        return {}


def _cached(key: str) -> ProbeResult | None:
    raw = _read_verdicts().get(key)
    if not isinstance(raw, dict):
        return None
    try:
        cand = Candidate(**raw["candidate"])
        checks = tuple(ProbeCheck(c["what"], float(c["max_abs"])) for c in raw["checks"])
        return ProbeResult(cand, checks, float(raw["plain_ms"]))
    except (KeyError, TypeError, ValueError):
        return None


def _store(key: str, res: ProbeResult) -> None:
    """Best effort: an unwritable cache only means the probe runs again next time."""
    try:
        path = _verdict_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        verdicts = _read_verdicts()
        raw = dataclasses.asdict(res)
        raw["machine"] = machine_id()
        verdicts[key] = raw
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdicts, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


__all__ = ["Candidate", "ProbeCheck", "ProbeResult", "StepPlan", "cache_dir", "candidates", "choose",
           "cpu_isa", "machine_id", "probe", "resolve_plan"]
