"""``specdeploy export base``: trace the base step with ``torch.onnx.export(dynamo=True)`` into a bundle.

The bundle is written into a temporary sibling directory and renamed at the end, so Ctrl-C or an
error leaves nothing half-written. Progress is printed stage by stage.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specdeploy.exporter.export.ort_graph import ATTENTION_FUSED, ATTENTION_GATHERED
from specdeploy.exporter.export.shared_data import store_once
from specdeploy.exporter.export.staging import (
    export_graph,
    graph_entry,
    package_versions,
    staged_bundle,
)
from specdeploy.runtime import contract
from specdeploy.runtime.architectures import architecture
from specdeploy.runtime.bundle import (
    TREE_TARGET,
    BundleManifest,
    Limits,
    ModelConfig,
    SourceInfo,
    TokenizerInfo,
    write_manifest,
)
from specdeploy.runtime.errors import BundleExistsError, SpecDeployError
from specdeploy.runtime.precision import FP32, GGUF, GGUF_Q4_1_BLOCKS, MATMULNBITS_BITS, Q4_1

Progress = Callable[[str], None]

DEFAULT_MAX_TREE = 64


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_config(hf_model, tokenizer, arch: str) -> ModelConfig:
    cfg = hf_model.config
    eos = cfg.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    gen = getattr(hf_model, "generation_config", None)
    geos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos_ids |= set(geos if isinstance(geos, (list, tuple)) else ([geos] if geos is not None else []))
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    desc = architecture(name=arch)
    vocab = tokenizer.get_vocab()
    eos_ids |= {int(vocab[t]) for t in desc.end_of_turn if t in vocab}  # the family's end-of-turn tokens
    max_pos = int(cfg.max_position_embeddings)
    window = desc.context_cap(cfg)
    if window and window < max_pos:
        # The step graph attends over the whole cache; cap the context at the window so it stays exact.
        max_pos = window
    return ModelConfig(
        architecture=arch,
        model_type=cfg.model_type,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        num_layers=int(cfg.num_hidden_layers),
        num_heads=int(cfg.num_attention_heads),
        num_kv_heads=int(cfg.num_key_value_heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
        max_position_embeddings=max_pos,
        eos_token_ids=tuple(sorted(int(e) for e in eos_ids)),
        bos_token_id=None if cfg.bos_token_id is None else int(cfg.bos_token_id),
    )


def write_tokenizer(tokenizer, dest: Path) -> TokenizerInfo:
    """Save tokenizer.json (for the lean ``tokenizers`` runtime) and record the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise SpecDeployError("The model's tokenizer has no fast (tokenizers) form; specdeploy needs one.")
    backend.save(str(dest / "tokenizer.json"))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    add_bos = bool(getattr(tokenizer, "add_bos_token", False))
    return TokenizerInfo(
        file="tokenizer.json",
        chat_template=template,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        add_bos_token=add_bos,
    )


def export_base(
    model: str | None,
    out: Path,
    force: bool = False,
    max_context: int | None = None,
    max_tree: int = DEFAULT_MAX_TREE,
    max_batch: int = 1,
    progress: Progress = _stderr,
    precision: str = "fp32",
    target: str | None = None,
    block_size: int | None = None,
    gguf_blocks: bool = True,
    feature_layers: tuple[int, ...] | str = (),
) -> BundleManifest:
    """Export the base decoder step of ``model`` (default: embedded SmolLM2) to a new bundle at ``out``.

    ``target`` picks the graphs: "trt" traces ``base.onnx`` with dynamo in standard ops (TensorRT,
    ONNX Runtime's GPU providers); "ort" writes ``base-ort.onnx`` op by op with ONNX Runtime's fused
    kernels (``ort_graph.py``; what the CPU runtime runs when present); "all" writes both. It defaults
    to "all" for fp32 and "ort" for the quantized precisions: "int8"/"int4" quantize the MatMul
    weights (ONNX Runtime's MatMulNBits, blocks of ``block_size``; see ``quantize.py``).

    From a ``Q4_1`` GGUF source (the embedded default) with fp32 weights, a third graph
    ``base-q4.onnx`` (target "ort", precision "gguf-q4_1") keeps the file's own 4-bit blocks: the same
    weights, a 1-token step ~1.5x faster on a bandwidth-bound CPU (``gguf_blocks.py``); the CPU
    runtime runs it for plain decoding (see ``BundleManifest.cpu_base``). ``gguf_blocks`` False skips it.

    ``precision`` "gguf" (any GGUF source) writes one ``ort`` graph that keeps the file's own blocks
    (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K at 4 or 8 bits; any other format re-quantized to 8 bits) with int8
    activations: the arithmetic llama.cpp uses for the file, and near-fp32 quality (no second rounding of
    the weights, unlike "int4"). The embedding rows are decoded from the file's blocks in the graph and
    the lm_head multiplies its blocks too; the manifest lists how each tensor is held. "q4_1" is its
    case for a GGUF whose decoder weights are all Q4_1 (the embedded default), and refuses any other.
    "gguf", "int8" and "int4" from a GGUF source decode the embedding from its blocks (no fp32 table; a
    Chimera draft added later then stores a table of its own); "q4_1" keeps the fp32 table, which the
    main job's Chimera draft shares.

    ``feature_layers`` makes every base graph also output ``layer_states``, those decoder layers' residual
    outputs (for drafts that fuse them, EAGLE-3); the logits and hidden states are computed as without.
    """
    from specdeploy.exporter.export.quantize import PrecisionError, quant_config, resolve_target
    from specdeploy.exporter.source import check_architecture, load_model
    from specdeploy.graphs.base_step import BaseStep
    from specdeploy.graphs.chimera import feature_layers_option

    target = resolve_target(precision, target)
    qconfig = quant_config(precision, block_size) if precision in MATMULNBITS_BITS else None
    out = Path(out)
    if out.exists() and not force:
        raise BundleExistsError(f"'{out}' already exists; pass --force to replace it.")
    t0 = time.time()
    progress("[1/4] loading model (offline) ...")
    loaded = load_model(model)
    hf = loaded.model
    arch = check_architecture(hf.config, loaded.path)
    mcfg = model_config(hf, loaded.tokenizer, arch)
    ctx = min(max_context or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    try:
        step = BaseStep(hf, feature_layers_option(feature_layers, mcfg.num_layers)).eval()
    except ValueError as exc:
        raise SpecDeployError(f"--feature-layers: {exc}.") from None
    if precision in (Q4_1, GGUF):
        from specdeploy.exporter.export.gguf_blocks import read_gguf_weights

        only = frozenset({"Q4_1"}) if precision == Q4_1 else None
        weights = read_gguf_weights(loaded.path, hf, only) if loaded.format == "gguf" else None
        if weights is None:
            raise PrecisionError(
                f"--precision {Q4_1} keeps a Q4_1 GGUF's own blocks, and '{loaded.path}' is not a GGUF whose "
                "decoder weights are all Q4_1; use --precision gguf or int4 instead." if precision == Q4_1 else
                f"--precision {GGUF} keeps a GGUF's own blocks, and '{loaded.path}' is not a GGUF; use "
                "--precision int4 or int8 instead.")
        with staged_bundle(out, force) as tmp:
            # q4_1 keeps the fp32 embedding table, which the main job's Chimera draft shares with it
            _write_gguf_blocks_base(step, weights, tmp, ctx + max_tree, progress, embedding=precision == GGUF)
            del weights
            gc.collect()
            entries = [graph_entry(tmp, "base", file, target=FORM_TARGETS[form], precision=precision)
                       for file, form in GRAPH_FORMS]
            return _finish_bundle(tmp, entries, loaded, mcfg, ctx, max_tree, max_batch, arch, precision,
                                  target, None, t0, progress)
    with staged_bundle(out, force) as tmp:
        entries = []
        if target in ("ort", "all"):  # first: its weight copies are freed before the trace's peak
            embedding = None
            if qconfig is not None and loaded.format == "gguf":
                from specdeploy.exporter.export.gguf_blocks import read_gguf_embedding

                embedding = read_gguf_embedding(loaded.path, hf)
            _write_ort_base(step, tmp, ctx + max_tree, qconfig, progress, embedding)
            entries += [graph_entry(tmp, "base", file, target=FORM_TARGETS[form], precision=precision)
                        for file, form in GRAPH_FORMS]
            blocks = None
            if qconfig is None and gguf_blocks and loaded.format == "gguf":
                from specdeploy.exporter.export.gguf_blocks import read_q4_1_linears

                blocks = read_q4_1_linears(loaded.path, hf)
                progress("      the GGUF's Q4_1 blocks decode bit for bit to the model's weights: writing them as "
                         f"4-bit blocks too ({GGUF_BASE_FILE}, for plain decoding)"
                         if blocks else "      the GGUF's weights are not all Q4_1: no block graph")
            if blocks:
                from specdeploy.exporter.export.ort_graph import export_ort_graph

                export_ort_graph(step, tmp / GGUF_BASE_FILE, ctx + max_tree, progress=progress, blocks=blocks)
                store_once(tmp, GGUF_BASE_FILE, [ORT_BASE_FILE], progress)
                entries.append(graph_entry(tmp, "base", GGUF_BASE_FILE, target="ort", precision=GGUF_Q4_1_BLOCKS))
            del blocks
            gc.collect()
        if target in ("trt", "all"):
            _trace_base(step, tmp / "base.onnx", arch, progress)
            store_once(tmp, "base.onnx", [e.file for e in entries], progress)
            entries.insert(0, graph_entry(tmp, "base", "base.onnx", target="trt", precision=FP32))
        return _finish_bundle(tmp, entries, loaded, mcfg, ctx, max_tree, max_batch, arch, precision, target,
                              qconfig, t0, progress)


def _finish_bundle(tmp: Path, entries: list, loaded, mcfg, ctx: int, max_tree: int, max_batch: int, arch: str,
                   precision: str, target: str, qconfig, t0: float, progress: Progress) -> BundleManifest:
    """Tokenizer, manifest and README of a staged bundle whose graphs are written."""
    progress(f"[3/4] writing tokenizer and manifest ({time.time() - t0:.0f}s) ...")
    tok = write_tokenizer(loaded.tokenizer, tmp)
    manifest = BundleManifest(
        model=mcfg,
        graphs=tuple(entries),
        limits=Limits(max_batch=max_batch, max_tree=max_tree, max_context=ctx),
        tokenizer=tok,
        source=SourceInfo(path=loaded.path, format=loaded.format, weight_sha=loaded.weight_sha),
        versions=package_versions("specdeploy", "torch", "transformers", "onnx", "onnxscript", "onnxruntime"),
    )
    write_manifest(tmp, manifest)
    (tmp / "README.txt").write_text(
        "specdeploy bundle. Run: specdeploy generate <this folder> --prompt '...'\n"
        + json.dumps({"model": loaded.path, "architecture": arch, "precision": precision, "target": target,
                      "quantization": None if qconfig is None else dataclasses.asdict(qconfig)}, indent=1)
        + "\n"
    )
    progress(f"[4/4] bundle complete ({time.time() - t0:.0f}s)")
    return manifest


ORT_BASE_FILE = "base-ort.onnx"
TREE_BASE_FILE = "base-tree.onnx"  # the ort graph whose rows attend in plain-step order (exact trees)
GGUF_BASE_FILE = "base-q4.onnx"  # the ort graph holding the source GGUF's own Q4_1 blocks


def _trace_base(step, path: Path, arch: str, progress: Progress) -> None:
    """The ``trt`` target: dynamo trace of ``step`` in standard ops."""
    import torch
    from specdeploy.graphs.base_step import example_inputs
    from torch.export import Dim

    progress(f"[2/4] tracing {arch} ({step.num_layers} layers) with torch.onnx.export(dynamo=True) ...")
    args = example_inputs(step)
    past = contract.past_names(step.num_layers)
    in_names = [*contract.INPUT_NAMES, *past]
    taps = [contract.LAYER_STATES] if step.feature_layers else []
    out_names = [contract.LOGITS, contract.HIDDEN_STATES, *taps, *contract.present_names(step.num_layers)]
    dims = {n: Dim(n) for n in (contract.BATCH, contract.TREE, contract.CAPACITY, contract.KEPT)}
    axes = {name: {axis: dims[d] for axis, d in enumerate(shape) if d in dims} for name, _, shape in contract.STEP_INPUTS}
    axes["past"] = [{axis: dims[d] for axis, d in enumerate(contract.kv_dims(1, 1)) if d in dims} for _ in past]
    with torch.no_grad():
        export_graph(step, args, path, in_names, out_names, axes)
    if step.feature_layers:  # say which layers ``layer_states`` holds
        import onnx

        proto = onnx.load(str(path), load_external_data=False)
        onnx.helper.set_model_props(proto, {contract.FEATURE_LAYERS_KEY: ",".join(map(str, step.feature_layers))})
        onnx.save(proto, str(path))


# Each ort-target writer writes every form: the fused graph and the exact-tree graph (each row's keys gathered in
# plain-step order, ort_gathered.py; also the rows of several sequences that batching runs), whose weights are
# then stored once with the fused graph's.
GRAPH_FORMS = ((ORT_BASE_FILE, ATTENTION_FUSED), (TREE_BASE_FILE, ATTENTION_GATHERED))
FORM_TARGETS = {ATTENTION_FUSED: "ort", ATTENTION_GATHERED: TREE_TARGET}
_FORM_LINES = {ATTENTION_GATHERED: "      the same graph with each row's keys in plain-step order, for exact trees "
                                   "and batching ..."}


def _share_forms(tmp: Path, progress: Progress) -> None:
    """The other forms' weights stored once, with the fused graph's."""
    for file, form in GRAPH_FORMS:
        if form != ATTENTION_FUSED:
            store_once(tmp, file, [ORT_BASE_FILE], progress, min_bytes=1)


def _write_gguf_blocks_base(step, weights, tmp: Path, max_positions: int, progress: Progress,
                            embedding: bool = True) -> None:
    """The ``q4_1`` and ``gguf`` precisions: the GGUF's own blocks with int8 activations, the embedding
    rows decoded from its blocks, the lm_head from its blocks at 8 bits (``gguf_blocks.py``)."""
    from specdeploy.exporter.export.ort_graph import WEIGHT_BLOCKS_KEY, export_ort_graph

    kept = ", ".join(f"{n} {kind}" for kind, n in sorted(weights.kept().items()))
    progress(f"[2/4] writing the ONNX Runtime graph from the GGUF's own blocks ({kept}; int8 activations) ...")
    if again := weights.requantized():
        progress(f"      {len(again)} tensors cannot keep their blocks and are re-quantized to 8 bits "
                 f"({', '.join(again[:4])}{' ...' if len(again) > 4 else ''})")
    held = weights.held
    if not embedding:
        held = tuple((name, "fp32" if name == "token_embd.weight" else how) for name, how in held)
    elif weights.embedding is None:
        progress("      the embedding's blocks do not decode exactly: it stays an fp32 table")
    for file, attention in GRAPH_FORMS:
        if attention in _FORM_LINES:
            progress(_FORM_LINES[attention])
        export_ort_graph(step, tmp / file, max_positions, progress=progress if attention == ATTENTION_FUSED else None,
                         blocks=weights.linears, block_accuracy=4, embedding=weights.embedding if embedding else None,
                         lm_head=weights.lm_head, props={WEIGHT_BLOCKS_KEY: json.dumps([list(pair) for pair in held])},
                         attention=attention)
    _share_forms(tmp, progress)
    progress("      int8 activations: at load the runtime probes which step plan keeps speculative output "
             "identical to plain on the machine (see runtime/plan.py)")


def _write_ort_base(step, tmp: Path, max_positions: int, qconfig, progress: Progress, embedding=None) -> None:
    """The ``ort`` target: the op-by-op fused graph and its exact-tree form, weight-quantized when ``qconfig`` is
    given."""
    from specdeploy.exporter.export.ort_graph import export_ort_graph
    from specdeploy.exporter.export.quantize import quantize_file

    progress("[2/4] writing the ONNX Runtime graph (fused GQA, rotary and norms) ...")
    written = tmp if qconfig is None else tmp / "fp32"
    if qconfig is not None:
        written.mkdir()
        if embedding is not None:
            progress(f"      the embedding keeps the GGUF's {embedding.kind} blocks (rows decoded in the graph)")
    for file, attention in GRAPH_FORMS:
        if attention in _FORM_LINES:
            progress(_FORM_LINES[attention])
        export_ort_graph(step, written / file, max_positions, progress=progress if attention == ATTENTION_FUSED else None,
                         embedding=embedding, attention=attention)
    if qconfig is not None:
        progress(f"[2/4] quantizing MatMul weights to {qconfig.bits} bits (MatMulNBits, block "
                 f"{qconfig.block_size}, lm_head {qconfig.lm_head_bits or 'fp32'}-bit) ...")
        for file, _ in GRAPH_FORMS:
            quantize_file(written / file, tmp / file, qconfig)
        shutil.rmtree(written)
    _share_forms(tmp, progress)
    if qconfig is not None and qconfig.accuracy_level == 4:
        progress("      int8 activations: at load the runtime probes which step plan keeps speculative output "
                 "identical to plain on the machine (see runtime/plan.py)")
