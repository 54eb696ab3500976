"""``specdeploy train data|chimera|medusa|cerberus|calibrate``: self-distilled drafts for a frozen base."""

from __future__ import annotations

from pathlib import Path

import click
from specdeploy.exporter.cli.options import (
    DATA_OPTION,
    DEVICE_OPTION,
    FEATURE_LAYERS_OPTION,
    MODEL_OPTION,
    THREADS_OPTION,
    TRAIN_TIME_OPTION,
    apply,
    reply_options,
)
from specdeploy.exporter.train.options import CHIMERA_DEFAULTS, HEADS_DEFAULTS
from specdeploy.runtime.drafters import kinds


@click.group()
def train() -> None:
    """Train a draft on ShareGPT with the frozen base model (self-distillation)."""


def _heads_train_options(fn):
    options = [
        MODEL_OPTION,
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
        *reply_options(),
        click.option("--vocab-trim", default=HEADS_DEFAULTS.vocab_trim, show_default=True, type=int,
                     help="Train and export on the N most frequent label ids (0: the full shared lm_head)."),
        DATA_OPTION,
        THREADS_OPTION,
        DEVICE_OPTION,
        TRAIN_TIME_OPTION,
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
    """``train medusa|cerberus``: the options make the run's config (``TrainRun``) for the kind's trainer
    (``run_heads_training``), then the calibration."""
    from specdeploy.exporter.train.run import TrainRun

    log = lambda m: click.echo(m, err=True)
    run = TrainRun.with_defaults(HEADS_DEFAULTS, **options)
    kinds.resolve(kinds.describe(kind).trainer)(kind, run, resume=resume or "auto", log=log)
    if calibrate:
        from specdeploy.exporter.workflows import calibrate_with_bundle

        calibrate_with_bundle(kind, run.out, run.model, bundle, calib_prompts, calib_tokens, run.threads, log)


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


@train.command(kinds.CHIMERA)
@MODEL_OPTION
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Weights file to write.")
@click.option("--heads", default=CHIMERA_DEFAULTS.heads, show_default=True, type=int, help="Draft depth: residual heads.")
@click.option("--epochs", default=CHIMERA_DEFAULTS.epochs, show_default=True, type=int)
@click.option("--batch-size", default=CHIMERA_DEFAULTS.batch_size, show_default=True, type=int,
              help="ShareGPT sequences per step.")
@click.option("--lr", default=CHIMERA_DEFAULTS.lr, show_default=True, type=float)
@click.option("--max-seqs", default=CHIMERA_DEFAULTS.max_seqs, show_default=True, type=int,
              help="ShareGPT sequences to cache.")
@click.option("--max-len", default=CHIMERA_DEFAULTS.max_len, show_default=True, type=int, help="Tokens per sequence.")
@apply(reply_options(CHIMERA_DEFAULTS.replies))
@click.option("--vocab-trim", default=CHIMERA_DEFAULTS.vocab_trim, show_default=True, type=int,
              help="Train (and export by default) on the N most useful ids; 0 = the full shared lm_head.")
@click.option("--feature-weight", default=0.1, show_default=True, type=float,
              help="Weight of the hidden-state regression term (0 turns it off).")
@FEATURE_LAYERS_OPTION
@DATA_OPTION
@THREADS_OPTION
@DEVICE_OPTION
@TRAIN_TIME_OPTION
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
    from specdeploy.exporter.train.run import TrainRun

    train_fn = kinds.resolve(kinds.describe(kinds.CHIMERA).trainer)  # run_chimera_training
    train_fn(kinds.CHIMERA, TrainRun.with_defaults(CHIMERA_DEFAULTS, **options), resume=resume or "auto")


@train.command("data")
@MODEL_OPTION
@click.option("--max-seqs", default=1024, show_default=True, type=int, help="ShareGPT sequences to cache.")
@click.option("--max-len", default=512, show_default=True, type=int, help="Tokens per sequence.")
@apply(reply_options("self"))
@DATA_OPTION
@THREADS_OPTION
@DEVICE_OPTION
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--time-limit", default=None, type=click.FloatRange(min=0),
              help="Stop after this many minutes, keeping the finished shards for the next run.")
@click.option("--keep-partial", is_flag=True,
              help="At the time limit, make the cache of the shards finished so far (fewer sequences than "
                   "--max-seqs) instead of leaving them for a rerun; the training commands then use it via --data.")
@FEATURE_LAYERS_OPTION
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
@THREADS_OPTION
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
