"""``specdeploy export draft --kind medusa|cerberus``: add the heads graph (and Cerberus' gate) to a bundle.

The heads graph takes ``hidden_states [B, N, H]`` and returns each head's top-k ids and log-probs
(``[B, N, K, k]``), so the shared lm_head projection and the TopK run inside ONNX Runtime and only
small arrays reach Python. Cerberus also gets ``cerberus-gate.onnx`` (entropy + learned gate). The
graphs are traced with ``torch.onnx.export(dynamo=True)`` and written into the bundle atomically; the
manifest records a :class:`DraftEntry` tied to the base by its weight hash, with the tree and gate
that the draft's calibration chose.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdeploy.exporter.train.modules import heads_from_weights
from specdeploy.exporter.train.weights import DraftWeights, check_draft_base, load_draft_weights
from specdeploy.runtime.bundle import (
    BundleManifest,
    DraftEntry,
    config_pairs,
    graph_paths,
    hash_files,
    read_manifest,
    write_manifest,
)
from specdeploy.runtime.draft_contract import CHIMERA_STEP, DYNAMIC_DIMS, GATE, HEADS, GraphContract
from specdeploy.runtime.drafters.kinds import TRAINED_KINDS, always_draft, describe, known, resolve
from specdeploy.runtime.errors import DraftMismatchError
from specdeploy.runtime.precision import (
    DRAFT_PRECISIONS,
    FP32,
    INT4,
    MATMULNBITS_BITS,
    QUANTIZED_DRAFT_PRECISIONS,
)

DEFAULT_TOPK = 10  # enough for the largest static tree (ranks 0..9) and the dynamic tree's width


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def calibration_path(draft: str | Path) -> Path:
    """Where a draft's calibration lives: ``<weights>.calibration.json`` next to the weights."""
    draft = Path(draft)
    return draft.with_name(draft.name.removesuffix(".safetensors") + ".calibration.json")


def read_calibration(path: Path, weights: DraftWeights) -> dict[str, Any]:
    """Load a calibration file and check it belongs to exactly these weights (one sentence otherwise)."""
    try:
        calib = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise DraftMismatchError(f"Cannot read the calibration file '{path}' ({exc}).") from None
    if calib.get("kind") != weights.config.kind:
        raise DraftMismatchError(f"'{path}' calibrates a {calib.get('kind')} draft, not a {weights.config.kind} draft.")
    if calib.get("weights_sha") != hash_files([weights.path]):
        raise DraftMismatchError(
            f"The calibration '{path}' was made for other {weights.config.kind} weights; rerun "
            "'specdeploy train calibrate' for these."
        )
    return calib


def vocab_map_for(weights: DraftWeights, vocab_trim: int | None):
    """The draft vocabulary's full ids (the N most useful, from the weights), or None for the full lm_head."""
    trim = weights.vocab_trim if vocab_trim is None else int(vocab_trim)
    order = weights.tensors.get("vocab_order")
    if trim and (order is None or trim > order.numel()):
        raise DraftMismatchError(
            f"The draft weights keep {0 if order is None else order.numel()} frequency-ordered ids; "
            f"cannot trim the vocabulary to {trim}."
        )
    return order[:trim] if trim else None


def draft_graph_module(weights: DraftWeights, lm_weight, topk: int = DEFAULT_TOPK, vocab_trim: int | None = None):
    """The traced torch module of a heads draft: heads + shared (maybe trimmed) lm_head + TopK."""
    from specdeploy.graphs.heads import DraftHeadsGraph

    vocab_map = vocab_map_for(weights, vocab_trim)
    return DraftHeadsGraph(heads_from_weights(weights), lm_weight, topk, vocab_map).eval()


def gate_module(weights: DraftWeights):
    """Cerberus' gate graph with the calibrated MLP (``gate.*`` tensors), or an untrained one."""
    import torch
    from specdeploy.graphs.gate import GateGraph

    with torch.random.fork_rng():  # an untrained gate is still the same graph every time it is rebuilt
        torch.manual_seed(0)
        gate = GateGraph(weights.config.hidden_size)
    state = weights.prefixed("gate.")
    if state:
        expected = gate.state_dict()
        if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
            raise DraftMismatchError(f"The gate tensors in '{weights.path}' do not match the gate graph's shapes.")
        gate.load_state_dict(state, strict=True)
    return gate.eval(), bool(state)


def _drop_graph_files(staged: Path, old: DraftEntry | None, manifest: BundleManifest) -> None:
    """Unlink a replaced draft's files from the staged copy (they are hard links to the live bundle's),
    except data files that another graph of the bundle still reads (shared weights)."""
    if old is None:
        return
    others = [*manifest.graphs, *(g for d in manifest.drafts if d is not old for g in d.graphs)]
    still_read = {p.name for g in others for p in graph_paths(staged, g)}
    for g in old.graphs:
        for p in graph_paths(staged, g):
            if p.name not in still_read:
                p.unlink(missing_ok=True)


def _share(tmp: Path, manifest: BundleManifest, file: str, earlier: list[str], progress: Callable[[str], None]) -> None:
    """Store ``file``'s weights that the bundle's base graphs (or ``earlier`` new graphs) hold only once."""
    from specdeploy.exporter.export.shared_data import store_once

    store_once(tmp, file, [g.file for g in manifest.graphs] + earlier, progress)


def _dynamic_shapes(contract: GraphContract, fused: bool = False) -> dict:
    """``torch.export`` dynamic shapes of ``contract``'s inputs: one :class:`Dim` per dynamic dimension name."""
    from torch.export import Dim

    dims = {name: Dim(name) for name in DYNAMIC_DIMS}
    return {name: None if axes is None else {i: dims[d] for i, d in axes.items()}
            for name, axes in contract.dynamic_axes(fused).items()}


def _check_precision(precision: str) -> None:
    if precision not in DRAFT_PRECISIONS:
        raise DraftMismatchError(f"Unknown draft precision '{precision}'; choose one of {', '.join(DRAFT_PRECISIONS)}.")


def export_draft(bundle: str | Path, kind: str, draft: str | Path, calibration: str | Path | None = None,
                 vocab_trim: int | None = None, topk: int = DEFAULT_TOPK, model: str | None = None,
                 progress: Callable[[str], None] = _stderr, use_calibration: bool = True,
                 precision: str = INT4) -> DraftEntry:
    """Add a trained draft of ``kind`` to ``bundle`` with the builder its description names
    (:func:`export_heads`, :func:`export_chimera`); replaces a previous draft of the same kind."""
    _check_precision(precision)
    desc = known(kind)
    if desc is None or desc.name not in TRAINED_KINDS:
        raise DraftMismatchError(f"Unknown draft kind '{kind}'; choose one of {', '.join(TRAINED_KINDS)}.")
    return resolve(desc.builder)(bundle, kind, draft, calibration=calibration, vocab_trim=vocab_trim, topk=topk,
                                 model=model, progress=progress, use_calibration=use_calibration, precision=precision)


def export_heads(bundle: str | Path, kind: str, draft: str | Path, calibration: str | Path | None = None,
                 vocab_trim: int | None = None, topk: int = DEFAULT_TOPK, model: str | None = None,
                 progress: Callable[[str], None] = _stderr, use_calibration: bool = True,
                 precision: str = INT4) -> DraftEntry:
    """Add a trained heads draft (Medusa, Cerberus) to ``bundle``; replaces a previous draft of the same kind.

    ``calibration`` defaults to ``<weights>.calibration.json`` when that exists; ``use_calibration``
    False ignores it (the calibration step itself exports the uncalibrated draft first).
    ``precision`` "int4" (the default) or "int8" writes the heads graph as ``<kind>-int4.onnx`` or
    ``<kind>-int8.onnx`` (MatMulNBits weights, int8 activations, as :func:`export_chimera` does), which
    the CPU drafter takes: its trimmed lm_head is most of a heads call, and 4-bit blocks read an eighth
    of the fp32 bytes. The fp32 ``<kind>.onnx`` is written as well where a TensorRT (``trt``) base graph
    can use it, or alone with "fp32". A gated kind's gate graph (a 578 -> 32 -> 1 MLP) stays fp32.
    """
    _check_precision(precision)
    import torch
    from specdeploy.exporter.export.staging import export_graph, graph_entry, updated_bundle
    from specdeploy.exporter.source import load_model
    from specdeploy.graphs.gate import example_gate_inputs
    from specdeploy.graphs.heads import example_hidden

    desc = describe(kind)
    role, gate_role = desc.role(HEADS).role, desc.gate_role  # role: the heads graph's (its file's) name
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    weights = load_draft_weights(draft, kind)
    m = manifest.model
    check_draft_base(weights.config, manifest.source.weight_sha, m.hidden_size, m.vocab_size, "the bundle's base model")
    cal_path = Path(calibration) if calibration else calibration_path(draft)
    wanted = use_calibration and (calibration is not None or cal_path.is_file())
    calib = read_calibration(cal_path, weights) if wanted else {}

    progress(f"[1/3] loading the base model's lm_head ({manifest.source.path}) ...")
    loaded = load_model(model or manifest.source.path)
    if loaded.weight_sha != manifest.source.weight_sha:
        raise DraftMismatchError("The model given is not the bundle's base model (weight hash differs).")
    lm_weight = loaded.model.lm_head.weight.detach()
    trim = calib.get("vocab_trim", weights.vocab_trim) if vocab_trim is None else vocab_trim
    graph = draft_graph_module(weights, lm_weight, topk, trim)
    cfg = weights.config
    settings: dict[str, Any] = {
        "kind": kind, "num_heads": cfg.num_heads, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "layers": cfg.layers, "topk": topk, "vocab_trim": int(trim or 0), "weights_path": str(Path(draft).resolve()),
    }
    for key in ("default_tree", "accept"):
        if calib.get(key) is not None:
            settings[key] = calib[key]
    gate_cal = calib.get("gate") or {}
    if gate_role and gate_cal:
        settings.update(gate_kind=gate_cal["kind"])  # the runtime gate decides per step from costs
    elif gate_role:
        progress(f"note: no gate calibration; '{kind}' will refuse to load, '{always_draft(kind)}' works.")

    old = next((d for d in manifest.drafts if d.kind == kind), None)
    keep_fp32 = precision == FP32 or _has_trt_base(manifest)
    with updated_bundle(bundle) as tmp:
        _drop_graph_files(tmp, old, manifest)
        progress(f"[2/3] tracing the {kind} heads ({cfg.num_heads} heads, vocabulary {trim or 'full'}) ...")
        fp32_file = f"{role}.onnx" if keep_fp32 else f".{role}-fp32.onnx"  # the latter only to quantize
        with torch.no_grad():
            export_graph(graph, (example_hidden(cfg.hidden_size),), tmp / fp32_file, list(HEADS.input_names()),
                         list(HEADS.output_names), _dynamic_shapes(HEADS))
        graphs = _draft_graphs(tmp, manifest, fp32_file, role, precision, keep_fp32, progress)
        if gate_role:
            gate, trained = gate_module(weights)
            if gate_cal and gate_cal["kind"] == "learned" and not trained:
                raise DraftMismatchError(f"The calibration picks the learned gate but '{draft}' holds no gate weights.")
            gate_file = f"{gate_role.role}.onnx"
            with torch.no_grad():
                export_graph(gate, example_gate_inputs(cfg.hidden_size, cfg.vocab_size), tmp / gate_file,
                             list(GATE.input_names()), list(GATE.output_names), _dynamic_shapes(GATE))
            _share(tmp, manifest, gate_file, [g.file for g in graphs], progress)
            graphs.append(graph_entry(tmp, gate_role.role, gate_file))
            settings["gate_trained"] = trained
        entry = DraftEntry(kind, cfg.base_weight_sha, hash_files([weights.path]), tuple(graphs), config_pairs(settings))
        drafts = tuple(d for d in manifest.drafts if d.kind != kind) + (entry,)
        write_manifest(tmp, manifest.replace(drafts=drafts))
        progress(f"[3/3] added {', '.join(g.file for g in graphs)} to {bundle}")
    return entry


def chimera_graph_module(weights: DraftWeights, embed_weight, lm_weight, topk: int = DEFAULT_TOPK,
                         vocab_trim: int | None = None):
    """The traced torch module of a Chimera draft step: trigram + layer + one residual head + TopK."""
    from specdeploy.exporter.train.modules import chimera_from_weights
    from specdeploy.graphs.chimera import ChimeraStepGraph, FusedChimeraStepGraph

    vocab_map = vocab_map_for(weights, vocab_trim)
    cls = FusedChimeraStepGraph if weights.config.feature_layers else ChimeraStepGraph
    return cls(chimera_from_weights(weights), embed_weight, lm_weight, topk, vocab_map).eval()


def _draft_quant(precision: str):
    from specdeploy.exporter.export.quantize import QuantConfig

    # int8 activations too (accuracy level 4): the fastest CPU kernel; safe here because the draft's
    # rounding can only change which tokens are proposed, never the verified output.
    bits = MATMULNBITS_BITS[precision]
    return QuantConfig(bits, accuracy_level=4, lm_head_bits=bits, lm_head_accuracy_level=4)


def _has_trt_base(manifest: BundleManifest) -> bool:
    """Whether the bundle has a TensorRT base graph, which would run a draft's fp32 graph."""
    return manifest.find_graph("base", "trt") is not None


def _quantized_graph(tmp: Path, manifest: BundleManifest, fp32_file: str, role: str, precision: str,
                     progress: Callable[[str], None]) -> list:
    """``<role>-<precision>.onnx`` (int8 or int4 weights) quantized from the staged fp32 graph, its shared
    weights stored once."""
    from specdeploy.exporter.export.quantize import quantize_file
    from specdeploy.exporter.export.staging import graph_entry

    file = f"{role}-{precision}.onnx"
    progress(f"[2/3] quantizing the draft's weights to {precision} ({file}) ...")
    quantize_file(tmp / fp32_file, tmp / file, _draft_quant(precision))
    _share(tmp, manifest, file, [], progress)
    return [graph_entry(tmp, f"{role}-{precision}", file, target="ort", precision=precision)]


def _draft_graphs(tmp: Path, manifest: BundleManifest, fp32_file: str, role: str, precision: str, keep_fp32: bool,
                  progress: Callable[[str], None]) -> list:
    """The draft's graph entries from its staged fp32 graph: the quantized one (precision int8 or int4)
    and, where kept, the fp32 one first (its shared weights stored once); an fp32 graph not kept is removed."""
    from specdeploy.exporter.export.staging import graph_entry

    graphs = (_quantized_graph(tmp, manifest, fp32_file, role, precision, progress)
              if precision in QUANTIZED_DRAFT_PRECISIONS else [])
    if keep_fp32:
        _share(tmp, manifest, fp32_file, [g.file for g in graphs], progress)
        graphs.insert(0, graph_entry(tmp, role, fp32_file))
    else:
        for leftover in (tmp / fp32_file, tmp / f"{fp32_file}.data"):
            leftover.unlink(missing_ok=True)
    return graphs


def export_chimera(bundle: str | Path, kind: str, draft: str | Path, vocab_trim: int | None = None,
                   topk: int = DEFAULT_TOPK, model: str | None = None, progress: Callable[[str], None] = _stderr,
                   precision: str = INT4, calibration: str | Path | None = None,
                   use_calibration: bool = True) -> DraftEntry:
    """Add a trained Chimera draft (``chimera.onnx``, one draft step with its own KV) to ``bundle``.

    ``precision`` "int4" (the default) writes ``chimera-int4.onnx`` (4-bit MatMulNBits blocks with int8
    activations, ONNX Runtime only; "int8": 8-bit blocks, ``chimera-int8.onnx``), which the CPU drafter
    prefers: a draft step reads ~8x fewer weight bytes than fp32 (a call measured 1.5 ms against int8's
    2.3-2.5 ms, with the same acceptance; docs/benchmarks.md, session 23). The draft's numerics never
    change the output (the base model verifies every token), only how often drafts are accepted. The
    fp32 graph ``chimera.onnx`` is written as well when the bundle has a TensorRT (``trt``) base graph,
    or alone with ``precision`` "fp32". The
    embedding table is the base graph's own bytes, stored once (:mod:`.shared_data`).
    """
    _check_precision(precision)
    import torch
    from specdeploy.exporter.export.staging import export_graph, updated_bundle
    from specdeploy.exporter.source import load_model
    from specdeploy.graphs.chimera import example_step_inputs

    bundle = Path(bundle)
    weights = load_draft_weights(draft, kind)
    role = describe(kind).role(CHIMERA_STEP).role
    manifest = read_manifest(bundle)
    taps = weights.config.feature_layers
    if taps:
        lacking = manifest.base_files_without(taps)
        if lacking:
            raise DraftMismatchError(
                f"'{draft}' fuses base layers {list(taps)}, but {', '.join(lacking)} "
                f"{'does' if len(lacking) == 1 else 'do'} not output them; re-export "
                f"the base with --feature-layers {','.join(map(str, taps))}.")
    m = manifest.model
    check_draft_base(weights.config, manifest.source.weight_sha, m.hidden_size, m.vocab_size, "the bundle's base model")
    progress(f"[1/3] loading the base model's embedding and lm_head ({manifest.source.path}) ...")
    loaded = load_model(model or manifest.source.path)
    if loaded.weight_sha != manifest.source.weight_sha:
        raise DraftMismatchError("The model given is not the bundle's base model (weight hash differs).")
    embed = loaded.model.model.embed_tokens.weight.detach()
    lm_weight = loaded.model.lm_head.weight.detach()
    trim = weights.vocab_trim if vocab_trim is None else int(vocab_trim)
    graph = chimera_graph_module(weights, embed, lm_weight, topk, trim)
    cfg = weights.config
    settings: dict[str, Any] = {
        "kind": kind, "num_heads": cfg.num_heads, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "num_kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "topk": topk, "vocab_trim": int(trim or 0),
        "weights_path": str(Path(draft).resolve()),
    }
    if taps:
        settings["feature_layers"] = ",".join(map(str, taps))
    cal_path = Path(calibration) if calibration else calibration_path(draft)
    if use_calibration and (calibration is not None or cal_path.is_file()):
        calib = read_calibration(cal_path, weights)
        if calib.get("default_tree"):
            settings["default_tree"] = calib["default_tree"]
    old = next((d for d in manifest.drafts if d.kind == kind), None)
    keep_fp32 = precision == FP32 or _has_trt_base(manifest)
    roles = ([role] if keep_fp32 else []) + ([f"{role}-{precision}"] if precision in QUANTIZED_DRAFT_PRECISIONS else [])
    if (old is not None and old.weights_sha == hash_files([weights.path]) and old.config == config_pairs(settings)
            and [g.role for g in old.graphs] == roles):
        progress(f"the Chimera draft in {bundle} is already these weights with these settings; nothing to do")
        return old
    with updated_bundle(bundle) as tmp:
        _drop_graph_files(tmp, old, manifest)
        progress(f"[2/3] tracing the Chimera draft step ({cfg.num_heads} heads, vocabulary {trim or 'full'}) ...")
        fp32_file = f"{role}.onnx" if keep_fp32 else f".{role}-fp32.onnx"  # the latter only to quantize
        with torch.no_grad():
            export_graph(graph, example_step_inputs(cfg), tmp / fp32_file, list(CHIMERA_STEP.input_names(bool(taps))),
                         list(CHIMERA_STEP.output_names), _dynamic_shapes(CHIMERA_STEP, bool(taps)))
        graphs = _draft_graphs(tmp, manifest, fp32_file, role, precision, keep_fp32, progress)
        entry = DraftEntry(kind, cfg.base_weight_sha, hash_files([weights.path]), tuple(graphs),
                           config_pairs(settings))
        drafts = tuple(d for d in manifest.drafts if d.kind != kind) + (entry,)
        write_manifest(tmp, manifest.replace(drafts=drafts))
        progress(f"[3/3] added {', '.join(g.file for g in graphs)} to {bundle}")
    return entry


def _entry_weights(entry: DraftEntry) -> DraftWeights:
    path = entry.setting("weights_path")
    if not path or not Path(path).is_file():
        raise DraftMismatchError(
            f"The {entry.kind} draft's weights file '{path}' is not found; cannot rebuild its torch reference."
        )
    weights = load_draft_weights(path, entry.kind)
    if hash_files([weights.path]) != entry.weights_sha:
        raise DraftMismatchError(f"'{path}' changed since the {entry.kind} draft was exported; re-export it.")
    return weights


def torch_draft_modules(entry: DraftEntry, lm_weight, embed_weight=None) -> dict[str, Any]:
    """Torch references of a draft's graphs, by role, from the weights the manifest names (the kind's
    ``reference``: :func:`chimera_modules`, :func:`heads_modules`)."""
    return resolve(describe(entry.kind).reference)(entry, lm_weight, embed_weight)


def chimera_modules(entry: DraftEntry, lm_weight, embed_weight=None) -> dict[str, Any]:
    if embed_weight is None:
        raise ValueError("the Chimera reference needs the base embedding")
    role = describe(entry.kind).role(CHIMERA_STEP).role
    return {role: chimera_graph_module(_entry_weights(entry), embed_weight, lm_weight, int(entry.setting("topk")),
                                       int(entry.setting("vocab_trim", 0)))}


def heads_modules(entry: DraftEntry, lm_weight, embed_weight=None) -> dict[str, Any]:
    weights = _entry_weights(entry)
    desc = describe(entry.kind)
    mods = {desc.role(HEADS).role: draft_graph_module(weights, lm_weight, int(entry.setting("topk")),
                                                      int(entry.setting("vocab_trim", 0)))}
    if desc.gate_role:
        mods[desc.gate_role.role] = gate_module(weights)[0]
    return mods
