"""What ``specdeploy bench`` can compare: a registry of variants and the runners that time them.

A variant is one declarative :class:`VariantSpec` entry; the runner kind it names does the work.
Adding a peer that runs like an existing kind (a new draft kind in the bundle, another
``transformers.generate`` option) is one entry in ``VARIANTS``. A new kind of peer (onnxruntime-genai,
llama.cpp) is one :class:`Runner` subclass registered in ``RUNNERS`` plus its entries, e.g.::

    VariantSpec("llama.cpp", "llama.cpp", "llama.cpp greedy on the source GGUF",
                requires=("llama_cpp",), install="pip install llama-cpp-python")

This module is imported by the parent bench process (to check names and availability) and by each
worker (to run one variant). Heavy packages (torch, transformers, onnxruntime) are imported only
inside the runner that needs them, so a worker for our runtime never loads torch.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdeploy.runtime.bundle import BundleManifest


@dataclass(frozen=True)
class VariantSpec:
    """One benchmark variant: how to run it and what it needs."""

    name: str
    runner: str  # key of RUNNERS
    description: str
    draft: str | None = None  # "ours": the runtime drafter (None = plain autoregressive)
    options: tuple[tuple[str, Any], ...] = ()  # runner-specific settings, e.g. extra generate() kwargs
    requires: tuple[str, ...] = ()  # importable modules; a missing one skips the variant
    install: str = ""  # how to get the missing modules
    bundle_draft: bool = False  # needs a draft of kind ``draft`` stored in the bundle
    draft_kind: str | None = None  # the bundle's draft kind when it differs from the drafter name

    def unavailable(self, manifest: BundleManifest) -> str | None:
        """Why this variant cannot run here (missing package or draft), or None when it can."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            hint = f" ({self.install})" if self.install else ""
            return f"skipped: needs the Python package(s) {', '.join(missing)}{hint}."
        kind = self.draft_kind or self.draft
        if self.bundle_draft and kind not in {d.kind for d in manifest.drafts}:
            return (f"skipped: the bundle has no '{kind}' draft; add one with "
                    f"'specdeploy export draft --kind {kind}'.")
        runner = RUNNERS.get(self.runner)
        return runner.unavailable(self, manifest) if runner is not None else None


_HF = ("torch", "transformers")
_HF_INSTALL = "pip install torch transformers"

VARIANTS: dict[str, VariantSpec] = {v.name: v for v in (
    VariantSpec("ar", "ours", "specdeploy ORT CPU, plain autoregressive (the baseline)",
                requires=("onnxruntime",)),
    VariantSpec("ar-fp32", "ours", "specdeploy ORT CPU, plain autoregressive on the fused fp32 graph only",
                options=(("backend", "ort-cpu-fp32"),), requires=("onnxruntime",)),
    VariantSpec("ar-traced", "ours", "specdeploy ORT CPU, plain autoregressive on the traced standard-op graph",
                options=(("backend", "ort-cpu-traced"),), requires=("onnxruntime",)),
    VariantSpec("prompt-lookup", "ours", "specdeploy ORT CPU, prompt-lookup tree drafts",
                draft="prompt-lookup", requires=("onnxruntime",)),
    VariantSpec("prompt-lookup-inexact", "ours", "specdeploy ORT CPU, prompt-lookup trees on the fastest step plan "
                "whether or not it is exact here (--allow-inexact; LOSSY where the probe refuses)",
                draft="prompt-lookup", options=(("allow_inexact", True),), requires=("onnxruntime",)),
    VariantSpec("chimera", "ours", "specdeploy ORT CPU, Chimera draft", draft="chimera",
                requires=("onnxruntime",), bundle_draft=True),
    VariantSpec("cerberus", "ours", "specdeploy ORT CPU, Cerberus heads with gate", draft="cerberus",
                requires=("onnxruntime",), bundle_draft=True),
    VariantSpec("cerberus-nogate", "ours", "specdeploy ORT CPU, Cerberus heads, gate off (always draft)",
                draft="cerberus-nogate", requires=("onnxruntime",), bundle_draft=True, draft_kind="cerberus"),
    VariantSpec("medusa", "ours", "specdeploy ORT CPU, Medusa heads", draft="medusa",
                requires=("onnxruntime",), bundle_draft=True),
    VariantSpec("hf", "hf", "transformers generate, greedy, fp32 torch", requires=_HF, install=_HF_INSTALL),
    VariantSpec("hf-prompt-lookup", "hf", "transformers assisted generation, prompt_lookup_num_tokens=10",
                options=(("prompt_lookup_num_tokens", 10),), requires=_HF, install=_HF_INSTALL),
)}

BASELINE = "ar"


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


class Runner(ABC):
    """Loads one variant once and times generations on token ids."""

    def __init__(self, bundle: Path, manifest: BundleManifest, spec: VariantSpec, threads: int,
                 tree: str | None):
        self.bundle, self.manifest, self.spec = bundle, manifest, spec
        self.threads, self.tree = threads, tree

    @classmethod
    def unavailable(cls, spec: VariantSpec, manifest: BundleManifest) -> str | None:
        """Why this runner cannot run ``spec`` on this bundle (beyond missing packages), or None."""
        return None

    @abstractmethod
    def generate(self, ids: list[int], max_new_tokens: int) -> RunResult:
        """Greedy generation of up to ``max_new_tokens`` after the prompt ``ids``."""

    def close(self) -> None:
        pass


class OursRunner(Runner):
    """The specdeploy runtime (``specdeploy.runtime.load``), plain or with a drafter."""

    @classmethod
    def unavailable(cls, spec: VariantSpec, manifest: BundleManifest) -> str | None:
        if dict(spec.options).get("backend") == "ort-cpu-traced" and not any(
                g.role == "base" and g.target == "trt" for g in manifest.graphs):
            return "skipped: the bundle has no traced (target trt) base graph; export with --target all."
        return None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        from specdeploy.runtime import load
        from specdeploy.runtime.errors import ExactnessWarning

        tree = self.tree if self.spec.draft else None
        options = dict(self.spec.options)
        with warnings.catch_warnings():  # a refused draft is reported in the results (``refused``)
            warnings.simplefilter("ignore", ExactnessWarning)
            self.engine = load(self.bundle, backend=options.get("backend", "ort-cpu"), draft=self.spec.draft,
                               threads=self.threads, tree=tree, allow_inexact=options.get("allow_inexact", False))

    def generate(self, ids: list[int], max_new_tokens: int) -> RunResult:
        from specdeploy.runtime.decode import DecodeStats, GenerationConfig, SamplingParams

        stats = DecodeStats()
        tokens = self.engine.generate_ids(ids, GenerationConfig(max_new_tokens, SamplingParams()), stats)
        return RunResult(
            tokens=[int(t) for t in tokens],
            seconds=stats.prefill_s + stats.decode_s,
            first_tokens=1,
            decode_seconds=stats.decode_s,
            accepted=list(stats.accepted),
            backend_seconds=stats.backend_s,
            finish_reason=stats.finish_reason,
            gate_parallel=stats.gate_parallel if self.spec.draft else None,
            gate_ar=stats.gate_ar if self.spec.draft else None,
            lossy=stats.lossy,
            plan=self.engine.plan.reason,
            refused=bool(self.spec.draft) and self.engine.draft_name == "none",
        )

    def close(self) -> None:
        self.engine.close()


class HfRunner(Runner):
    """``transformers`` ``generate`` on the bundle's source model, greedy and fp32.

    A streamer timestamps every forward pass: the first one ends the prefill (decode tokens/s is
    measured after it), and the tokens each later pass emits give tau and the histogram, also for
    assisted generation, which streams each verified chunk at once.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import torch

        from .source import load_model

        torch.set_num_threads(self.threads)
        self.torch = torch
        self.model = load_model(self.manifest.source.path).model  # fp32, eval mode
        self.eos = [int(e) for e in self.manifest.model.eos_token_ids]

    def generate(self, ids: list[int], max_new_tokens: int) -> RunResult:
        from transformers import GenerationConfig

        torch = self.torch
        cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                               eos_token_id=self.eos, pad_token_id=self.eos[0], **dict(self.spec.options))
        clock = _StepClock()
        input_ids = torch.tensor([ids], dtype=torch.long)  # [1, L]
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      generation_config=cfg, streamer=clock)
        t1 = time.perf_counter()
        tokens = [int(t) for t in out[0, len(ids):].tolist()]
        counts = clock.counts
        if not counts or sum(counts) != len(tokens):  # the streamer did not see every step: no tau
            return RunResult(tokens, t1 - t0, 1, 0.0, None)
        finish = "stop" if tokens and tokens[-1] in self.eos else "length"
        return RunResult(tokens, t1 - t0, counts[0], t1 - clock.times[0], counts[1:], None, finish)


class _StepClock:
    """A transformers streamer that records when each forward pass's tokens arrive, and how many."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate() first streams the prompt itself
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


RUNNERS: dict[str, type[Runner]] = {"ours": OursRunner, "hf": HfRunner}

# Peers (onnxruntime-genai, llama.cpp) register their runners and variants on import; their packages
# are optional and imported only inside the runners.
from . import bench_peers  # noqa: F401
