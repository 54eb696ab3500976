"""The types every ``specdeploy bench`` variant shares: its declaration, one timed result, and the runner ABC."""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdeploy.exporter.bench.structured import Constraint
from specdeploy.runtime.bundle import BundleManifest
from specdeploy.runtime.errors import SpecDeployError

BASELINE = "ar"


class BenchError(SpecDeployError):
    """A bench worker failed or a bench option is invalid."""


@dataclass(frozen=True)
class VariantSpec:
    """One benchmark variant: how to run it and what it needs."""

    name: str
    runner: str  # key of registry.RUNNERS
    description: str
    draft: str | None = None  # "ours": the runtime drafter (None = plain autoregressive)
    options: tuple[tuple[str, Any], ...] = ()  # runner-specific settings, e.g. extra generate() kwargs
    requires: tuple[str, ...] = ()  # importable modules; a missing one skips the variant
    install: str = ""  # how to get the missing modules
    bundle_draft: bool = False  # needs a draft of kind ``draft`` stored in the bundle
    draft_kind: str | None = None  # the bundle's draft kind when it differs from the drafter name
    plain: str | None = None  # a peer's speculative variant: the name of that peer's own plain variant

    def unavailable(self, manifest: BundleManifest) -> str | None:
        """Why this variant cannot run here (missing package or draft), or None; the registry adds the runner's own check."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            hint = f" ({self.install})" if self.install else ""
            return f"skipped: needs the Python package(s) {', '.join(missing)}{hint}."
        kind = self.draft_kind or self.draft
        if self.bundle_draft and kind not in {d.kind for d in manifest.drafts}:
            return (f"skipped: the bundle has no '{kind}' draft; add one with "
                    f"'specdeploy export draft --kind {kind}'.")
        return None


@dataclass(frozen=True)
class RunResult:
    """One timed generation, as a worker reports it (JSON-serialisable)."""

    tokens: list[int]  # new token ids, EOS included when reached
    seconds: float  # end to end: prompt ids in -> new ids out, prefill included
    first_tokens: int  # tokens produced by the first forward pass (1 for a plain prefill)
    decode_seconds: float  # after the first forward pass
    accepted: list[int] | None  # tokens emitted per decode step (first forward excluded)
    backend_seconds: float | None = None  # decode time inside the backend's step (ours only)
    finish_reason: str = ""
    gate_parallel: int | None = None  # decode steps the drafter's gate sent to draft + verify (ours only)
    gate_ar: int | None = None  # decode steps the gate ran as plain T=1 decoding (ours only)
    lossy: bool = False  # inexact speculation, allowed by the variant (ours only)
    plan: str | None = None  # the step plan's one line (ours only)
    refused: bool = False  # the variant's draft was refused: no exact step plan here, so plain decoding
    # What explains the number (ours only): the measured step-cost curve {rows: cost relative to one row}
    # and the drafter's running costs (draft call and step, ms) after this generation.
    profile: dict | None = None
    tool_calls: list[dict] | None = None  # the calls the runner parsed from its answer (OpenAI's form), if any
    # bench --repeats: every repeat's end-to-end seconds, and whether every repeat gave the same tokens (see pooled)
    repeat_seconds: list[float] | None = None
    repeats_agree: bool = True


def pooled(runs: list[RunResult]) -> RunResult:
    """One prompt's repeats as one result: the repeat with the median end-to-end time (of an even count, the faster
    middle one), with every repeat's time, and whether every repeat produced the same tokens."""
    if len(runs) == 1:
        return runs[0]
    middle = sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]
    return replace(middle, repeat_seconds=[r.seconds for r in runs],
                   repeats_agree=all(r.tokens == runs[0].tokens for r in runs))


@dataclass(frozen=True)
class StructuredPrompt:
    """A constrained prompt as an OpenAI request carries it: its messages (those the prompt ids render) and what
    its answer must be."""

    messages: tuple[dict, ...]
    constraint: Constraint

    def to_json(self) -> dict:
        return {"messages": list(self.messages), "constraint": self.constraint.keywords()}

    @classmethod
    def from_json(cls, data: dict) -> StructuredPrompt:
        return cls(tuple(data["messages"]), Constraint.from_keywords(data["constraint"]))


@dataclass(frozen=True)
class Score:
    """One teacher-forced text: ``argmax[i]`` is the top-1 token after ``ids[:i + 1]``, ``nll[i]`` the
    negative log-likelihood of ``ids[i + 1]`` there (so ``len(nll) == len(argmax) - 1``)."""

    argmax: list[int]
    nll: list[float]


def score_logits(logits: Any, ids: list[int]) -> Score:
    """A :class:`Score` from logits [N, V] (any array-like) for ``ids`` [N]."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    top = x.max(-1, keepdims=True)
    logp = x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return Score([int(a) for a in x.argmax(-1)], [float(v) for v in nll])


class Runner(ABC):
    """Loads one variant once and times generations on token ids."""

    constrains = False  # whether generate() decodes under a StructuredPrompt's constraint

    def __init__(self, bundle: Path, manifest: BundleManifest, spec: VariantSpec, threads: int,
                 tree: str | None):
        self.bundle, self.manifest, self.spec = bundle, manifest, spec
        self.threads, self.tree = threads, tree

    @classmethod
    def unavailable(cls, spec: VariantSpec, manifest: BundleManifest) -> str | None:
        """Why this runner cannot run ``spec`` on this bundle (beyond missing packages), or None."""
        return None

    @abstractmethod
    def generate(self, ids: list[int], max_new_tokens: int, structured: StructuredPrompt | None = None) -> RunResult:
        """Greedy generation of up to ``max_new_tokens`` after the prompt ``ids``; ``structured``: the prompt's
        messages and constraint, which a runner that :attr:`constrains` decodes under (``ids`` render them)."""

    def score(self, ids: list[int]) -> Score | None:
        """Teacher-forced quality inputs on ``ids``: the argmax at every position and the negative
        log-likelihood of each next token; None when this runner cannot give logits."""
        return None

    def close(self) -> None:
        pass
