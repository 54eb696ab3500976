"""``specdeploy export base|draft``: a bundle from a model, and drafts added to it."""

from __future__ import annotations

from pathlib import Path

import click
from specdeploy.exporter.cli.options import MODEL_OPTION, SOURCE_MODEL_OPTION
from specdeploy.runtime.drafters import kinds
from specdeploy.runtime.precision import DRAFT_PRECISIONS, EXPORT_PRECISIONS, INT4, MATMULNBITS_BITS


@click.group()
def export() -> None:
    """Export the base model or a draft into a bundle."""


@export.command("base")
@MODEL_OPTION
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Bundle directory to write.")
@click.option("--force", is_flag=True, help="Replace an existing bundle.")
@click.option("--max-context", type=int, default=None, help="Maximum prompt + generated tokens.")
@click.option("--max-tree", type=int, default=64, show_default=True, help="Maximum tree nodes per step.")
@click.option("--precision", default="fp32", show_default=True,
              type=click.Choice(EXPORT_PRECISIONS),
              help="Weight precision. int8/int4: MatMulNBits blocks with int8 activations (ONNX Runtime only); "
                   "gguf: any GGUF's own blocks (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K; others re-quantized to 8 bits) "
                   "with int8 activations (llama.cpp's arithmetic); q4_1: its case for an all-Q4_1 GGUF.")
@click.option("--block-size", type=int, default=None,
              help="int8/int4: weights per quantization block (power of two >= 16; default 32).")
@click.option("--target", type=click.Choice(["all", "ort", "trt"]), default=None,
              help="Graph targets: trt (dynamo trace in standard ops, TensorRT-parseable), ort (ONNX Runtime's "
                   "fused kernels, what the CPU runtime runs; the only target of int8/int4/q4_1/gguf), or all "
                   "(both; the default for fp32).")
@click.option("--gguf-blocks/--no-gguf-blocks", default=True, show_default=True,
              help="From a Q4_1 GGUF (the default model), also write base-q4.onnx, the ort graph with the file's "
                   "own 4-bit blocks (the same weights, ~2x fewer bytes per step), which plain CPU decoding runs.")
@click.option("--feature-layers", default="", metavar="LAYERS",
              help="Also output these decoder layers' residual states (comma-separated, 0-based; 'eagle3' for "
                   "EAGLE-3's low, mid and high taps), for Chimera drafts that fuse them.")
def export_base_cmd(model: str | None, out: Path, force: bool, max_context: int | None, max_tree: int,
                    precision: str, block_size: int | None, target: str | None, gguf_blocks: bool,
                    feature_layers: str) -> None:
    """Export the base decoder step (tree attention, in-place KV) to ONNX.

    \b
    Two graphs of the same step: base.onnx (target trt), a dynamo trace in standard ops for TensorRT
    and the GPU providers; base-ort.onnx (target ort), written op by op with ONNX Runtime's fused
    GroupQueryAttention, RotaryEmbedding and SkipSimplifiedLayerNormalization kernels, which the CPU
    runtime prefers. 'specdeploy validate' checks both against torch.

    \b
    int8/int4 quantize the MatMul weights blockwise with ONNX Runtime's MatMulNBitsQuantizer, and the
    kernels quantize their activations to int8 (onnxruntime-genai's recipe; the KV cache stays fp32).
    gguf keeps a GGUF's own blocks instead (no second rounding: near-fp32 quality), the embedding and
    lm_head included, and the manifest lists how each tensor is held; q4_1 is its case for a GGUF whose
    decoder weights are all Q4_1 (the embedded default). At load the
    runtime probes which step plan keeps speculative output identical to plain output on the machine.
    Check them with 'specdeploy validate', which adds a quality report (top-1 agreement and perplexity
    against fp32). fp16 is not exported for the CPU: build TensorRT engines with
    'specdeploy build --precision fp16' instead.

    \b
    Examples:
      specdeploy export base --out bundles/smollm2
      specdeploy export base --precision int4 --out bundles/smollm2-int4
      specdeploy export base --precision q4_1 --out bundles/smollm2-q4_1
      specdeploy export base --model qwen2.5-coder-0.5b --precision gguf --out bundles/qwen-gguf
    """
    from specdeploy.exporter.export.base import export_base

    if block_size is not None and precision not in MATMULNBITS_BITS:
        raise click.UsageError("--block-size applies to --precision int8 or int4 only.")
    export_base(model, out, force=force, max_context=max_context, max_tree=max_tree, precision=precision,
                target=target, block_size=block_size, gguf_blocks=gguf_blocks, feature_layers=feature_layers)
    click.echo(f"Wrote bundle {out}")


@export.command("draft")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--kind", required=True, type=click.Choice((*kinds.TRAINED_KINDS, kinds.NGRAM)), help="Draft kind.")
@click.option("--draft", "draft", required=True, type=click.Path(path_type=Path),
              help="Draft weights (.safetensors); for ngram, the base model's replies (.npz of 'train data').")
@click.option("--calibration", default=None, type=click.Path(path_type=Path),
              help="Calibration JSON (default: <weights>.calibration.json next to the weights, if present).")
@click.option("--vocab-trim", type=int, default=None,
              help="Draft vocabulary: the N most frequent ids, 0 = full lm_head (default: the calibrated choice).")
@SOURCE_MODEL_OPTION
@click.option("--precision", type=click.Choice(DRAFT_PRECISIONS), default=INT4, show_default=True,
              help="Trained drafts: int8 or int4 writes a draft graph of that weight width (int8 "
                   "activations), which the CPU drafter runs (plus the fp32 one where a TensorRT base graph can "
                   "use it); fp32 writes only the fp32 graph. The draft's rounding never changes the output.")
def export_draft_cmd(bundle: Path, kind: str, draft: Path, calibration: Path | None, vocab_trim: int | None,
                     model: str | None, precision: str) -> None:
    """Add a trained Chimera draft, Medusa or Cerberus heads (and Cerberus' gate), or an n-gram table to a bundle.

    The draft graphs return top-k ids and log-probs, so the shared lm_head projection runs inside ONNX
    Runtime. Chimera's graph is one draft step over its own small KV cache. The draft must have been
    trained for the bundle's base model.

    \b
    Examples:
      specdeploy export draft --kind chimera --draft graphs/weights/chimera.safetensors bundles/smollm2
      specdeploy export draft --kind cerberus --draft graphs/weights/cerberus.safetensors bundles/smollm2
      specdeploy export draft --kind ngram --draft graphs/weights/self-replies.npz bundles/smollm2
    """
    if kind == kinds.NGRAM:
        from specdeploy.exporter.export.ngram import export_ngram

        export_ngram(bundle, draft)
        click.echo(f"Added the {kind} table to {bundle}")
        return
    from specdeploy.exporter.export.draft import export_draft

    export_draft(bundle, kind, draft, calibration=calibration, vocab_trim=vocab_trim, model=model, precision=precision)
    click.echo(f"Added the {kind} draft to {bundle}")


# --- train -----------------------------------------------------------------------------------
