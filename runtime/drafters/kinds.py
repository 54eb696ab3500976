"""The draft kinds: one declarative :class:`DraftKind` per kind, which every other module asks.

A description names the kind, the bundle draft it reads, its graph roles with their contracts
(:mod:`..draft_contract`), the behaviour that differs between kinds (a gate, a place in ``auto``,
batching) and the code that builds, trains, calibrates, validates, runs and benchmarks it. That code
is named as ``"module:function"`` and imported only when used (:func:`resolve`), as the backend
plugins are: the runtime reads these descriptions without importing torch or the exporter. Adding a
kind is one description here plus the modules it names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ..draft_contract import CHIMERA_STEP, GATE, HEADS, GraphContract

# The names (what ``--draft`` accepts, the manifest's draft kinds, the bench variants).
NONE = "none"  # plain decoding
AUTO = "auto"
PROMPT_LOOKUP = "prompt-lookup"
NGRAM = "ngram"
SUFFIX = "suffix"
CHIMERA = "chimera"
MEDUSA = "medusa"
CERBERUS = "cerberus"
CERBERUS_NOGATE = "cerberus-nogate"
HYBRID = "hybrid"

_EXPORT = "specdeploy.exporter.export.draft"
_TRAIN_HEADS = "specdeploy.exporter.train.heads:run_heads_training"
_CAL_HEADS = "specdeploy.exporter.calibrate.heads:calibrate"
_REF = "specdeploy.exporter.reference.torch_drafters"
_MAKE = "specdeploy.runtime.drafters.make"


@dataclass(frozen=True)
class GraphRole:
    """A graph a draft kind stores in the bundle: its manifest role (and file stem; quantized copies add
    ``-int4``/``-int8``) and its contract."""

    role: str
    contract: GraphContract


@dataclass(frozen=True)
class DraftKind:
    """One draft kind. Code is named lazily (``"module:function"``, see :func:`resolve`).

    - ``maker(request: make.DraftRequest) -> Drafter``: makes the runtime drafter ``--draft NAME`` gets;
    - ``model(name, bundle_dir, manifest, tree, threads, chains) -> Drafter``: a trained kind's own drafter
      on ONNX Runtime (the one ``hybrid``, ``auto`` and the paid draft wrap);
    - ``builder(bundle, kind, draft, **options) -> DraftEntry``: ``export draft --kind NAME``;
    - ``trainer``: ``train NAME``; ``calibrator(bundle, kind, draft, prompts=, max_new_tokens=, threads=,
      progress=) -> dict``: ``train calibrate --kind NAME``;
    - ``reference(entry, lm_weight, embed_weight) -> {role: torch module}``: the traced modules, for parity;
    - ``validate(bundle_dir, entry, loaded, prompt_ids, feeds, progress) -> [OutputCheck]``: torch vs ORT;
    - ``torch_maker(name, manifest, embed, lm, device, dtype, tree, chains) -> Drafter``: makes the drafter in
      torch.
    """

    name: str
    summary: str
    bundle_kind: str | None = None  # the bundle draft entry it reads (None: it needs none)
    roles: tuple[GraphRole, ...] = ()
    gated: bool = False  # asks the kind's gate graph before every step
    auto_model: bool = False  # ``auto`` adds this trained draft where the bundle has it (first in this order)
    batches: bool = False  # batched rows (max_batch > 1) can draft with it
    default_model: str | None = None  # ``hybrid``: the trained draft when none is named (hybrid:KIND)
    maker: str | None = None
    model: str | None = None
    builder: str | None = None
    trainer: str | None = None
    calibrator: str | None = None
    reference: str | None = None
    validate: str | None = None
    torch_maker: str | None = None
    bench_variant: str | None = None

    @property
    def trained(self) -> bool:
        """Whether it runs a trained draft that a bundle stores (alone or in ``hybrid:NAME``)."""
        return self.model is not None

    def role(self, contract: GraphContract) -> GraphRole | None:
        """The role of this kind's graph with ``contract`` (None: the kind has no such graph)."""
        return next((r for r in self.roles if r.contract is contract), None)

    @property
    def gate_role(self) -> GraphRole | None:
        return self.role(GATE)


_HEADS_CODE = {"model": f"{_MAKE}:heads_model", "builder": f"{_EXPORT}:export_heads", "trainer": _TRAIN_HEADS,
               "calibrator": _CAL_HEADS, "reference": f"{_EXPORT}:heads_modules",
               "validate": "specdeploy.exporter.check.validate:compare_heads",
               "torch_maker": f"{_REF}:heads_bundle_drafter", "maker": f"{_MAKE}:trained_alone"}
_CERBERUS_ROLES = (GraphRole(CERBERUS, HEADS), GraphRole(f"{CERBERUS}-gate", GATE))

KINDS: tuple[DraftKind, ...] = (
    DraftKind(AUTO, "per step: lookup/n-grams, suffix, the bundle's trained draft or a plain step, by value per cost",
              maker=f"{_MAKE}:auto", bench_variant=AUTO),
    DraftKind(PROMPT_LOOKUP, "prompt-lookup tree drafts from the context (no training)", batches=True,
              maker=f"{_MAKE}:prompt_lookup", bench_variant=PROMPT_LOOKUP),
    DraftKind(NGRAM, "prompt lookup + the base model's own n-gram table (a table from its replies, no weights)",
              bundle_kind=NGRAM, batches=True, maker=f"{_MAKE}:ngram",
              builder="specdeploy.exporter.export.ngram:build_ngram", bench_variant=NGRAM),
    DraftKind(SUFFIX, "this request's context and earlier requests' outputs (a cache shared across requests)",
              maker=f"{_MAKE}:suffix", bench_variant=SUFFIX),
    DraftKind(CHIMERA, "trigram encoder + one decoder layer + residual heads, with its own KV cache",
              bundle_kind=CHIMERA, roles=(GraphRole(CHIMERA, CHIMERA_STEP),), auto_model=True,
              maker=f"{_MAKE}:trained_alone", model=f"{_MAKE}:chimera_model", builder=f"{_EXPORT}:export_chimera",
              trainer="specdeploy.exporter.train.chimera:run_chimera_training",
              calibrator="specdeploy.exporter.calibrate.chimera:calibrate",
              reference=f"{_EXPORT}:chimera_modules", validate="specdeploy.exporter.check.validate:compare_chimera",
              torch_maker=f"{_REF}:chimera_bundle_drafter", bench_variant=CHIMERA),
    DraftKind(MEDUSA, "Medusa-style heads over the base's last hidden state", bundle_kind=MEDUSA,
              roles=(GraphRole(MEDUSA, HEADS),), auto_model=True, bench_variant=MEDUSA, **_HEADS_CODE),
    DraftKind(CERBERUS, "Cerberus heads (sequential blocks) with the calibrated gate", bundle_kind=CERBERUS,
              roles=_CERBERUS_ROLES, gated=True, auto_model=True, bench_variant=CERBERUS, **_HEADS_CODE),
    DraftKind(CERBERUS_NOGATE, "the Cerberus heads with the gate off (always draft)", bundle_kind=CERBERUS,
              roles=_CERBERUS_ROLES, model=f"{_MAKE}:heads_model", maker=f"{_MAKE}:trained_alone",
              torch_maker=f"{_REF}:heads_bundle_drafter", bench_variant=CERBERUS_NOGATE),
    DraftKind(HYBRID, "prompt lookup + a trained draft in one tree; hybrid:KIND picks the draft", default_model=CHIMERA,
              maker=f"{_MAKE}:hybrid", bench_variant=HYBRID),
)
_BY_NAME = {k.name: k for k in KINDS}

TRAINED_KINDS = tuple(k.name for k in KINDS if k.builder and k.trained)  # drafts with their own trained weights
HEADS_KINDS = tuple(k.name for k in KINDS if k.name in TRAINED_KINDS and k.role(HEADS))  # heads over the hidden state
TRAINED_DRAFTS = tuple(k.name for k in KINDS if k.trained)  # --draft names that run a trained draft (or hybrid:KIND)
AUTO_MODELS = tuple(k.name for k in KINDS if k.auto_model)  # the trained draft ``auto`` adds, the first the bundle has
DRAFTS = (NONE, *(k.name for k in KINDS))  # what --draft accepts (and hybrid:KIND)


def describe(name: str) -> DraftKind:
    """The description of draft kind ``name`` (``hybrid:KIND`` is the hybrid's); KeyError when unknown."""
    return _BY_NAME[name.partition(":")[0] if name.startswith(HYBRID + ":") else name]


def known(name: str | None) -> DraftKind | None:
    """The description of ``name``, or None where it names no kind."""
    try:
        return describe(name or "")
    except KeyError:
        return None


def hybrid_name(model: str) -> str:
    """``hybrid:MODEL``: the hybrid over the trained draft ``model``."""
    return f"{HYBRID}:{model}"


def hybrid_model(name: str) -> str:
    """The trained draft a hybrid ``name`` runs (``hybrid`` alone: the hybrid's default)."""
    return name.partition(":")[2] or describe(HYBRID).default_model


def always_draft(kind: str) -> str:
    """The name that runs the bundle draft ``kind`` on every step (the ungated form where it has a gate)."""
    return next(k.name for k in KINDS if k.bundle_kind == kind and k.trained and not k.gated)


def bundle_draft(name: str) -> str | None:
    """The bundle draft kind the drafter ``name`` needs (a hybrid's: its model's), or None where it needs none."""
    kind = describe(name)
    return describe(hybrid_model(name)).bundle_kind if kind.name == HYBRID else kind.bundle_kind


def bench_variant(name: str) -> str:
    """The bench variant that runs ``--draft name`` (``hybrid:KIND`` keeps its model)."""
    kind = describe(name)
    return kind.bench_variant + name[len(kind.name):]


def resolve(dotted: str) -> Callable:
    """The function ``"package.module:function"`` names, imported now."""
    module, _, attr = dotted.partition(":")
    return getattr(importlib.import_module(module), attr)


def draft_name_error(name: str) -> str | None:
    """Why ``name`` is not something ``--draft`` accepts, in one sentence; None when it is."""
    if name in DRAFTS:
        return None
    if name.startswith(HYBRID + ":"):
        if name.partition(":")[2] in TRAINED_DRAFTS:
            return None
        return f"'{name}': the hybrid's model must be one of {', '.join(TRAINED_DRAFTS)}."
    return f"Unknown draft '{name}'; choose one of {', '.join(DRAFTS)}, or hybrid:KIND."
