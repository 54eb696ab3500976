"""The ``specdeploy`` command line.

User errors (``SpecDeployError``) print as one line without a traceback; anything else is a bug and
keeps its traceback. ``generate`` and ``serve`` import only the lean runtime (no torch); commands
that trace or train import torch lazily.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from specdeploy.exporter.cli_decode import bench, bench_serve, generate, serve
from specdeploy.exporter.train.options import CHIMERA_DEFAULTS, HEADS_DEFAULTS
from specdeploy.runtime.drafters import kinds
from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.precision import (
    DRAFT_PRECISIONS,
    ENGINE_PRECISIONS,
    EXPORT_PRECISIONS,
    FP16,
    INT4,
    MATMULNBITS_BITS,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecDeployError as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            ctx.exit(130)


@click.group(cls=_Group)
@click.version_option(package_name="specdeploy")
def main() -> None:
    """specdeploy: export LLMs with their drafts to ONNX/TensorRT and decode them fast and losslessly."""


# --- export ----------------------------------------------------------------------------------
@main.group()
def export() -> None:
    """Export the base model or a draft into a bundle."""


@export.command("base")
@click.option("--model", "model", default=None, help="HF folder, .gguf file or a named model (default: embedded SmolLM2-135M; qwen2.5-coder-0.5b with the qwen extra).")
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
@click.option("--model", default=None, help="Source model, if it moved since export.")
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
@main.group()
def train() -> None:
    """Train a draft on ShareGPT with the frozen base model (self-distillation)."""


def _reply_options(default: str = HEADS_DEFAULTS.replies) -> list:
    return [
        click.option("--replies", default=default, show_default=True, type=click.Choice(["sharegpt", "self"]),
                     help="Train on ShareGPT's own replies, or on the base model's greedy replies to each "
                          "conversation's first turn (the text the draft meets at run time)."),
        click.option("--reply-tokens", default=HEADS_DEFAULTS.reply_tokens, show_default=True, type=int,
                     help="Longest self-generated reply (--replies self)."),
        click.option("--engine", default=None, type=click.Path(path_type=Path),
                     help="Make the training data through this bundle's runtime (its base graph on ONNX Runtime, "
                          "batched): replies, hidden states and labels in one pass."),
        click.option("--replies-file", default=None, type=click.Path(path_type=Path, exists=True, dir_okay=False),
                     help="Take the self replies from this file (the replies.npz every self-reply data cache "
                          "holds) instead of generating them; the features are derived again."),
    ]


def _apply(options: list):
    def deco(fn):
        for opt in reversed(options):
            fn = opt(fn)
        return fn
    return deco


_THREADS_OPTION = click.option("--threads", default=HEADS_DEFAULTS.threads, show_default=True, type=click.IntRange(min=1),
                               help="torch (and ONNX Runtime) threads.")  # the training and calibration commands
_DATA_OPTION = click.option("--data", "data_dir", default=None, type=click.Path(path_type=Path),
                            help="Training-data cache directory (default: under ~/.cache/specdeploy/train-data).")
_TRAIN_TIME_OPTION = click.option(
    "--time-limit", default=None, type=click.FloatRange(min=0),
    help="Stop training after this many minutes (the data is made first, without this limit), then evaluate and "
         "write the weights reached.")
_DEVICE_OPTION = click.option(
    "--device", default="auto", show_default=True,
    help="Where data generation and training run: auto (cuda when torch sees a GPU), cpu, cuda or cuda:N. "
         "On a GPU the matmuls run under bf16 autocast.")


def _heads_train_options(fn):
    options = [
        click.option("--model", default=None, help="HF folder, .gguf file or a named model (default: embedded SmolLM2-135M; qwen2.5-coder-0.5b with the qwen extra)."),
        click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Weights file to write."),
        click.option("--heads", default=HEADS_DEFAULTS.heads, show_default=True, type=int, help="Number of heads."),
        click.option("--layers", default=1, show_default=True, type=int, help="ResBlocks per head (Medusa)."),
        click.option("--epochs", default=HEADS_DEFAULTS.epochs, show_default=True, type=int),
        click.option("--batch-size", default=HEADS_DEFAULTS.batch_size, show_default=True, type=int,
                     help="Positions per step."),
        click.option("--lr", default=HEADS_DEFAULTS.lr, show_default=True, type=float),
        click.option("--max-seqs", default=HEADS_DEFAULTS.max_seqs, show_default=True, type=int,
                     help="ShareGPT sequences to cache."),
        click.option("--max-len", default=HEADS_DEFAULTS.max_len, show_default=True, type=int,
                     help="Tokens per sequence."),
        *_reply_options(),
        click.option("--vocab-trim", default=HEADS_DEFAULTS.vocab_trim, show_default=True, type=int,
                     help="Train and export on the N most frequent label ids (0: the full shared lm_head)."),
        _DATA_OPTION,
        _THREADS_OPTION,
        _DEVICE_OPTION,
        _TRAIN_TIME_OPTION,
        click.option("--seed", default=HEADS_DEFAULTS.seed, show_default=True, type=int),
        click.option("--resume", "resume", flag_value="require", help="Insist on resuming a checkpoint."),
        click.option("--restart", "resume", flag_value="restart", help="Discard any checkpoint and start over."),
        click.option("--calibrate/--no-calibrate", default=True, show_default=True,
                     help="Afterwards choose the default tree (and Cerberus' gate) on held-in prompts."),
        click.option("--bundle", default=None, type=click.Path(path_type=Path),
                     help="Base bundle to calibrate with (default: a temporary export); the draft is added to it."),
        click.option("--calib-prompts", default=24, show_default=True, type=int),
        click.option("--calib-tokens", default=128, show_default=True, type=int),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _train_heads(kind: str, *, resume: str | None, calibrate: bool, bundle: Path | None, calib_prompts: int,
                 calib_tokens: int, **options) -> None:
    """``train medusa|cerberus``: the options go to the kind's trainer (``run_heads_training``) by name, then the
    calibration."""
    log = lambda m: click.echo(m, err=True)
    kinds.resolve(kinds.describe(kind).trainer)(kind, resume=resume or "auto", log=log, **options)
    if calibrate:
        from specdeploy.exporter.workflows import calibrate_with_bundle

        calibrate_with_bundle(kind, options["out"], options["model"], bundle, calib_prompts, calib_tokens,
                              options["threads"], log)


@train.command(kinds.MEDUSA)
@_heads_train_options
def train_medusa(**kw) -> None:
    """Train Medusa-1 heads (ResBlocks + the shared lm_head; head k predicts token t+2+k).

    Caches base features for ShareGPT once, trains with a 0.8^k per-head loss, resumes from its last
    checkpoint automatically, logs held-out per-head top-1 per epoch, then calibrates the default tree.

    \b
    Example:
      specdeploy train medusa --out medusa.safetensors --epochs 3
    """
    _train_heads(kinds.MEDUSA, **kw)


@train.command(kinds.CERBERUS)
@_heads_train_options
def train_cerberus(**kw) -> None:
    """Train Cerberus heads (sequential blocks chain head k-1 into head k), then calibrate tree and gate.

    The gate (entropy of the base distribution, or a learned MLP) is calibrated on held-in ShareGPT
    prompts to maximise tokens/s measured on this machine.

    \b
    Example:
      specdeploy train cerberus --out cerberus.safetensors --epochs 3
    """
    _train_heads(kinds.CERBERUS, **kw)


_FEATURE_LAYERS_OPTION = click.option(
    "--feature-layers", default="", metavar="LAYERS",
    help="Fuse these base layers' residual states into the draft's input (EAGLE-3; comma-separated, 0-based, or "
         "'eagle3' for its low, mid and high taps). The data keeps them; the bundle must be exported with the same.")


@train.command(kinds.CHIMERA)
@click.option("--model", default=None, help="HF folder, .gguf file or a named model (default: embedded SmolLM2-135M; qwen2.5-coder-0.5b with the qwen extra).")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Weights file to write.")
@click.option("--heads", default=CHIMERA_DEFAULTS.heads, show_default=True, type=int, help="Draft depth: residual heads.")
@click.option("--epochs", default=CHIMERA_DEFAULTS.epochs, show_default=True, type=int)
@click.option("--batch-size", default=CHIMERA_DEFAULTS.batch_size, show_default=True, type=int,
              help="ShareGPT sequences per step.")
@click.option("--lr", default=CHIMERA_DEFAULTS.lr, show_default=True, type=float)
@click.option("--max-seqs", default=CHIMERA_DEFAULTS.max_seqs, show_default=True, type=int,
              help="ShareGPT sequences to cache.")
@click.option("--max-len", default=CHIMERA_DEFAULTS.max_len, show_default=True, type=int, help="Tokens per sequence.")
@_apply(_reply_options(CHIMERA_DEFAULTS.replies))
@click.option("--vocab-trim", default=CHIMERA_DEFAULTS.vocab_trim, show_default=True, type=int,
              help="Train (and export by default) on the N most useful ids; 0 = the full shared lm_head.")
@click.option("--feature-weight", default=0.1, show_default=True, type=float,
              help="Weight of the hidden-state regression term (0 turns it off).")
@_FEATURE_LAYERS_OPTION
@_DATA_OPTION
@_THREADS_OPTION
@_DEVICE_OPTION
@_TRAIN_TIME_OPTION
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--resume", "resume", flag_value="require", help="Insist on resuming a checkpoint.")
@click.option("--restart", "resume", flag_value="restart", help="Discard any checkpoint and start over.")
def train_chimera(resume: str | None, **options) -> None:
    """Train a Chimera draft (trigram encoder + one decoder layer + residual heads), base frozen.

    By default the training text is the base model's own greedy replies to ShareGPT first turns
    (generated once, ~29 min here), with the base's hidden states cached once (fp16); an interrupted
    run resumes from its last checkpoint when rerun with the same settings. The defaults reproduce
    the shipped draft (graphs/weights/README.md): about 70 min on 2 cores.

    \b
    Example:
      specdeploy train chimera --out chimera.safetensors
    """
    train_fn = kinds.resolve(kinds.describe(kinds.CHIMERA).trainer)  # run_chimera_training
    train_fn(resume=resume or "auto", **options)  # the options by name: one list of them


@train.command("data")
@click.option("--model", default=None, help="HF folder, .gguf file or a named model (default: embedded SmolLM2-135M; qwen2.5-coder-0.5b with the qwen extra).")
@click.option("--max-seqs", default=1024, show_default=True, type=int, help="ShareGPT sequences to cache.")
@click.option("--max-len", default=512, show_default=True, type=int, help="Tokens per sequence.")
@_apply(_reply_options("self"))
@_DATA_OPTION
@_THREADS_OPTION
@_DEVICE_OPTION
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--time-limit", default=None, type=click.FloatRange(min=0),
              help="Stop after this many minutes, keeping the finished shards for the next run.")
@click.option("--keep-partial", is_flag=True,
              help="At the time limit, make the cache of the shards finished so far (fewer sequences than "
                   "--max-seqs) instead of leaving them for a rerun; the training commands then use it via --data.")
@_FEATURE_LAYERS_OPTION
def train_data(model: str | None, max_seqs: int, max_len: int, replies: str, reply_tokens: int, engine: Path | None,
               replies_file: Path | None, data_dir: Path | None, threads: int, device: str, seed: int,
               time_limit: float | None, keep_partial: bool, feature_layers: str) -> None:
    """Make (or go on making) the training data alone: replies, base hidden states and labels.

    The same options as a train command find the same cache, so `train chimera|medusa|cerberus` then
    starts training at once. With --time-limit it stops between shards and keeps the replies made so
    far in replies.partial.npz; the same command resumes.

    \b
    Example (the data of the shipped drafts' next training, through the runtime):
      specdeploy train data --max-seqs 5120 --engine bundles/smollm2 --time-limit 60
    """
    from specdeploy.exporter.source import load_model
    from specdeploy.exporter.train.data import data_config, training_cache
    from specdeploy.exporter.train.options import resolve_device, resolve_feature_layers

    log = lambda m: click.echo(m, err=True)
    device = resolve_device(device)
    loaded = load_model(model)
    taps = resolve_feature_layers(feature_layers, loaded.model.config)
    config = data_config(max_seqs, max_len, seed, replies, reply_tokens, replies_file=replies_file,
                         feature_layers=taps)
    cache = training_cache(loaded, config, data_dir, engine, threads=threads, device=device, log=log,
                           time_limit_s=None if time_limit is None else time_limit * 60, keep_partial=keep_partial)
    if cache is not None:
        click.echo(str(cache.path))


@train.command("calibrate")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--kind", required=True, type=click.Choice(kinds.TRAINED_KINDS))
@click.option("--draft", "draft", required=True, type=click.Path(path_type=Path), help="Draft weights (.safetensors).")
@click.option("--prompts", default=None, type=int,
              help="Held-in ShareGPT prompts (default: 24 to trace for heads, 6 to time for chimera).")
@click.option("--max-new-tokens", default=None, type=int, help="Tokens per prompt (default: 128 heads, 96 chimera).")
@_THREADS_OPTION
def train_calibrate(bundle: Path, kind: str, draft: Path, prompts: int | None, max_new_tokens: int | None,
                    threads: int) -> None:
    """Re-calibrate a draft's default tree (and Cerberus' gate) for this machine; updates the bundle.

    Writes <weights>.calibration.json (and, for Cerberus, the learned gate into the weights file).
    Chimera's trees are timed in the real decode loop against plain decoding.

    \b
    Examples:
      specdeploy train calibrate bundles/smollm2 --kind cerberus --draft cerberus.safetensors
      specdeploy train calibrate bundles/smollm2 --kind chimera --draft graphs/weights/chimera.safetensors
    """
    given = {k: v for k, v in (("prompts", prompts), ("max_new_tokens", max_new_tokens)) if v}  # else its defaults
    calib = kinds.resolve(kinds.describe(kind).calibrator)(bundle, kind, draft, threads=threads, **given)
    speed = f" ({calib['speedup']}x plain on held-in prompts)" if "speedup" in calib else ""
    gate = calib.get("gate")
    tail = f", gate {gate['kind']} threshold {gate['threshold']}" if gate else ""
    click.echo(f"Calibrated {kind}: tree {calib['default_tree']}{speed}{tail}")


# --- validate --------------------------------------------------------------------------------
@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--model", default=None, help="Source model, if it moved since export.")
@click.option("--backend", "backend", default="ort-cpu", show_default=True,
              type=click.Choice(["ort-cpu", "trt", "ort-cuda", "ort-trt"]),
              help="ort-cpu: torch vs ONNX Runtime; trt/ort-cuda/ort-trt: that GPU backend vs ONNX Runtime CPU.")
def validate(bundle: Path, model: str | None, backend: str) -> None:
    """Compare torch with ONNX Runtime on prefill, step and tree cases; ends with PASSED or FAILED.

    \b
    With --backend trt, every TensorRT engine built for this GPU is compared with ONNX Runtime on the
    CPU (polygraphy runners, per-output tolerances per precision).
    """
    from specdeploy.exporter.check.validate import validate_bundle
    from specdeploy.runtime.errors import ValidationFailed

    try:
        if backend == "ort-cpu":
            validate_bundle(bundle, model, progress=click.echo)
        else:
            from specdeploy.exporter.check.trt import validate_backend

            validate_backend(bundle, backend, progress=click.echo)
    except ValidationFailed as exc:
        click.echo(f"FAILED: {exc}")
        sys.exit(1)
    click.echo("PASSED")


# --- lint / build (GPU path) ------------------------------------------------------------------
@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
def lint(bundle: Path) -> None:
    """Check every graph against what TensorRT's parser and ORT CUDA graphs accept; ends with PASSED or FAILED.

    \b
    Rules: opset range, standard domain only, no If/Loop/Scan, no sequences, no data-dependent
    output shapes. Every offending node is listed with the rule it breaks.

    \b
    Example:
      specdeploy lint bundles/smollm2
    """
    from specdeploy.exporter.check.lint import lint_bundle

    results = lint_bundle(bundle)
    for g in results:
        state = f"skipped: {g.skipped}" if g.skipped else ("ok" if g.passed else f"{len(g.issues)} issue(s)")
        click.echo(f"{g.role:<15}{g.file:<28}{state}")
        for issue in g.issues:
            click.echo(f"  {issue}")
    if all(g.passed for g in results):
        click.echo("PASSED")
    else:
        click.echo("FAILED")
        sys.exit(1)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--precision", default=FP16, show_default=True, type=click.Choice(ENGINE_PRECISIONS))
@click.option("--max-tree", type=int, default=None, help="Largest tree step T (default: the bundle's limit).")
@click.option("--max-context", type=int, default=None, help="Longest context (default: the bundle's limit).")
@click.option("--max-batch", type=int, default=None, help="Largest batch (default: the bundle's limit).")
@click.option("--workspace-gb", type=float, default=4.0, show_default=True, help="TensorRT workspace limit.")
def build(bundle: Path, precision: str, max_tree: int | None, max_context: int | None, max_batch: int | None,
          workspace_gb: float) -> None:
    """Build TensorRT engines for this GPU into BUNDLE/engines/ and record them in the manifest.

    Needs an NVIDIA GPU and the tensorrt package. Prefill and tree decoding get their own optimization
    profiles; the timing cache persists in BUNDLE/engines/timing.cache.

    \b
    Example:
      specdeploy build bundles/smollm2 --precision fp16 --max-tree 64 --max-context 2048
    """
    from specdeploy.exporter.build.trt import BuildConfig, build_engines

    config = BuildConfig(precision, max_tree, max_context, max_batch, workspace_gb)
    entries = build_engines(bundle, config, progress=lambda m: click.echo(m, err=True))
    for e in entries:
        click.echo(f"built {e.file}")


# --- generate, bench, serve, bench-serve (cli_decode.py) ---------------------------------------------------------
for _command in (generate, bench, serve, bench_serve):
    main.add_command(_command)


if __name__ == "__main__":
    main()
