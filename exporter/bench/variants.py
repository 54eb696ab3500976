"""What ``specdeploy bench`` can compare: a registry of variants and the runners that time them.

A variant is one declarative :class:`VariantSpec` entry; the runner kind it names does the work.
Adding a peer that runs like an existing kind (a new draft kind in the bundle, another
``transformers.generate`` option) is one entry in ``OWN_VARIANTS``. A new kind of peer (onnxruntime-genai,
llama.cpp) is one :class:`Runner` subclass in ``registry.RUNNERS`` plus its entries, e.g.::

    VariantSpec("llama.cpp", "llama.cpp", "llama.cpp greedy on the source GGUF",
                requires=("llama_cpp",), install="pip install llama-cpp-python")

This module is imported by the parent bench process (to check names and availability) and by each
worker (to run one variant). Heavy packages (torch, transformers, onnxruntime) are imported only
inside the runner that needs them, so a worker for our runtime never loads torch.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from specdeploy.exporter.bench.spec import (
    Runner,
    RunResult,
    Score,
    StructuredPrompt,
    VariantSpec,
    score_logits,
)
from specdeploy.runtime.drafters.kinds import (
    AUTO,
    CERBERUS,
    CERBERUS_NOGATE,
    CHIMERA,
    HYBRID,
    MEDUSA,
    NGRAM,
    PROMPT_LOOKUP,
    SUFFIX,
    bench_variant,
    bundle_draft,
    hybrid_name,
)

_HF = ("torch", "transformers")
_GATHERED_AR = "ar-gathered"
_LONE_AR = "ar-lone"
_HF_INSTALL = "pip install torch transformers"
UNCONSTRAINED_AR = "ar-unconstrained"  # plain decoding of a constrained prompt set's prompts without the constraint


def _ours(draft: str | None, description: str, name: str | None = None, **kw: Any) -> VariantSpec:
    """Our runtime with ``--draft draft`` (None: plain), named by the draft kind's bench variant; a variant whose
    drafter reads a bundle draft (the kind's description says which) needs that draft in the bundle."""
    reads = bundle_draft(draft) if draft else None
    return VariantSpec(name or bench_variant(draft), "ours", f"specdeploy ORT CPU, {description}", draft=draft,
                       requires=("onnxruntime",), bundle_draft=reads is not None,
                       draft_kind=reads if reads != draft else None, **kw)


OWN_VARIANTS = (
    _ours(None, "plain autoregressive (the baseline)", name="ar"),
    # A structured prompt set's prompts (the same ids) with no response_format or tool_choice: what the constraint
    # costs plain decoding (bench adds it to such a run).
    _ours(None, "plain autoregressive, the prompts' constraint left out", name=UNCONSTRAINED_AR,
          options=(("unconstrained", True),)),
    _ours(PROMPT_LOOKUP, "prompt-lookup tree drafts"),
    _ours(PROMPT_LOOKUP, "prompt lookup with --allow-inexact: where the probe finds no exact step plan here, trees "
          "on the fastest plan anyway (LOSSY); else as prompt-lookup", name=f"{bench_variant(PROMPT_LOOKUP)}-inexact",
          options=(("allow_inexact", True),)),
    _ours(NGRAM, "prompt lookup or the model's own n-gram table, per step"),
    _ours(SUFFIX, "suffix drafts from this prompt and earlier outputs (a cache shared across the run's requests)"),
    _ours(AUTO, "per step: lookup/n-grams, suffix, the bundle's trained draft or a plain step, whichever is worth "
          "most per unit of cost"),
    _ours(CHIMERA, "Chimera draft"),
    _ours(HYBRID, "prompt lookup + the Chimera draft in one tree"),
    _ours(hybrid_name(MEDUSA), "prompt lookup + the Medusa heads"),
    _ours(hybrid_name(CERBERUS), "prompt lookup + the Cerberus heads"),
    _ours(CERBERUS, "Cerberus heads with gate"),
    _ours(CERBERUS_NOGATE, "Cerberus heads, gate off (always draft)"),
    _ours(MEDUSA, "Medusa heads"),
    # The exact-tree step plan (--step-plan gathered: each row's keys in plain-step order), whatever the probe would
    # choose: its plain decoding is the reference of its drafts (same as own plain), ar stays the speed baseline.
    _ours(None, "plain autoregressive on the exact-tree step plan ('gathered')", name=_GATHERED_AR,
          options=(("step_plan", "gathered"),)),
    *(_ours(draft, f"{what} on the exact-tree step plan ('gathered'), trees verified as trees",
            name=f"{bench_variant(draft)}-gathered", options=(("step_plan", "gathered"),), plain=_GATHERED_AR)
      for draft, what in ((PROMPT_LOOKUP, "prompt-lookup tree drafts"), (CHIMERA, "Chimera draft"),
                          (MEDUSA, "Medusa heads"), (CERBERUS_NOGATE, "Cerberus heads, gate off"))),
    # The fastest exact plan for one sequence at a time (--step-plan lone), where the probe's choice is the plan
    # whose rows batch: the exactness tax, side by side.
    _ours(None, "plain autoregressive on the fastest exact plan for one sequence (not batch-invariant)",
          name=_LONE_AR, options=(("step_plan", "lone"),)),
    _ours(AUTO, "auto on the fastest exact plan for one sequence (not batch-invariant)", name="auto-lone",
          options=(("step_plan", "lone"),), plain=_LONE_AR),
    VariantSpec("hf", "hf", "transformers generate, greedy, fp32 torch", requires=_HF, install=_HF_INSTALL),
    VariantSpec("hf-prompt-lookup", "hf", "transformers assisted generation, prompt_lookup_num_tokens=10",
                options=(("prompt_lookup_num_tokens", 10),), requires=_HF, install=_HF_INSTALL),
)


class OursRunner(Runner):
    """The specdeploy runtime (``specdeploy.runtime.load``), plain or with a drafter; a structured prompt goes
    through ``Engine.stream`` with its messages and constraint, as a caller of the Python API sends it."""

    constrains = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        from specdeploy.runtime import load
        from specdeploy.runtime.errors import ExactnessWarning

        tree = self.tree if self.spec.draft else None
        options = dict(self.spec.options)
        with warnings.catch_warnings():  # a refused draft is reported in the results (``refused``)
            warnings.simplefilter("ignore", ExactnessWarning)
            self.engine = load(self.bundle, backend=options.get("backend", "ort-cpu"), draft=self.spec.draft,
                               threads=self.threads, tree=tree, allow_inexact=options.get("allow_inexact", False),
                               step_plan=options.get("step_plan"))

    def _profile(self) -> dict:
        drafter = self.engine.decoder.drafter
        curve, meter = self.engine.cost_curve, self.engine.decoder.cost_meter
        return {"cost_curve": {int(t): round(float(c), 4) for t, c in curve.items()} if curve else None,
                "cost_curve_loop": dict(meter.curve) if meter is not None and meter.updates else None,
                **(drafter.profile() if drafter is not None else {})}

    def generate(self, ids: list[int], max_new_tokens: int, structured: StructuredPrompt | None = None) -> RunResult:
        from specdeploy.runtime.decode import DecodeStats, GenerationConfig, SamplingParams

        tool_calls = None
        if structured is not None and not dict(self.spec.options).get("unconstrained"):
            completion = self.engine.generate(messages=list(structured.messages), max_new_tokens=max_new_tokens,
                                              temperature=0.0, **structured.constraint.keywords())
            stats, tokens = completion.stats, list(completion.token_ids)
            tool_calls = [dict(c) for c in getattr(completion, "tool_calls", None) or ()] or None
        else:
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
            profile=self._profile(),
            tool_calls=tool_calls,
        )

    def score(self, ids: list[int]) -> Score:
        """The bundle's base graph on ``ids`` as one prefill with logits at every position (the graph
        every one of our variants decodes with, so their quality class is one and the same)."""
        if getattr(self, "_logits", None) is None:
            from specdeploy.exporter.check.quality import ort_logits_fn

            self._logits = ort_logits_fn(self.bundle, self.manifest, self.threads)
        return score_logits(self._logits(ids), ids)

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
        from specdeploy.exporter.source import load_model

        torch.set_num_threads(self.threads)
        self.torch = torch
        self.model = load_model(self.manifest.source.path).model  # fp32, eval mode
        self.eos = [int(e) for e in self.manifest.model.eos_token_ids]

    def generate(self, ids: list[int], max_new_tokens: int, structured: StructuredPrompt | None = None) -> RunResult:
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

    def score(self, ids: list[int]) -> Score:
        """fp32 torch logits of the source model: the reference every quality class is measured against."""
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0]
        return score_logits(logits.float().numpy(), ids)


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


OWN_RUNNERS: dict[str, type[Runner]] = {"ours": OursRunner, "hf": HfRunner}
