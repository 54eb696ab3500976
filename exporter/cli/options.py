"""The options more than one command takes, each defined once."""

from __future__ import annotations

from pathlib import Path

import click
from specdeploy.exporter.train.options import HEADS_DEFAULTS
from specdeploy.runtime.backends import backend_names
from specdeploy.runtime.drafters.kinds import AUTO, DRAFTS, draft_name_error

MODEL_OPTION = click.option(
    "--model", default=None,
    help="HF folder, .gguf file or a named model (default: embedded SmolLM2-135M; qwen2.5-coder-0.5b with the "
         "qwen extra).")
SOURCE_MODEL_OPTION = click.option("--model", default=None, help="Source model, if it moved since export.")


def reply_options(default: str = HEADS_DEFAULTS.replies) -> list:
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


def apply(options: list):
    def deco(fn):
        for opt in reversed(options):
            fn = opt(fn)
        return fn
    return deco


THREADS_OPTION = click.option("--threads", default=HEADS_DEFAULTS.threads, show_default=True, type=click.IntRange(min=1),
                               help="torch (and ONNX Runtime) threads.")  # the training and calibration commands
DATA_OPTION = click.option("--data", "data_dir", default=None, type=click.Path(path_type=Path),
                            help="Training-data cache directory (default: under ~/.cache/specdeploy/train-data).")
TRAIN_TIME_OPTION = click.option(
    "--time-limit", default=None, type=click.FloatRange(min=0),
    help="Stop training after this many minutes (the data is made first, without this limit), then evaluate and "
         "write the weights reached.")
DEVICE_OPTION = click.option(
    "--device", default="auto", show_default=True,
    help="Where data generation and training run: auto (cuda when torch sees a GPU), cpu, cuda or cuda:N. "
         "On a GPU the matmuls run under bf16 autocast.")


FEATURE_LAYERS_OPTION = click.option(
    "--feature-layers", default="", metavar="LAYERS",
    help="Fuse these base layers' residual states into the draft's input (EAGLE-3; comma-separated, 0-based, or "
         "'eagle3' for its low, mid and high taps). The data keeps them; the bundle must be exported with the same.")


# --- decoding ----------------------------------------------------------------------------------------
BACKEND_CHOICE = click.Choice(list(backend_names()))


class DraftName(click.ParamType):
    """``--draft``: a name of ``kinds.DRAFTS``, or ``hybrid:KIND`` (refused in one sentence otherwise)."""

    name = "draft"

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(DRAFTS) + "|hybrid:KIND]"

    def convert(self, value, param, ctx):
        if (why := draft_name_error(value)) is not None:
            self.fail(why, param, ctx)
        return value


def decode_options(command):
    """The options ``generate`` and ``serve`` share: the draft, its tree, the backend, threads, --allow-inexact,
    --step-plan."""
    options = [
        click.option("--draft", default=AUTO, show_default=True, type=DraftName(),
                     help="auto (per step: lookup/n-grams, suffix cache, the bundle's trained draft or a plain step, "
                          "whichever pays most here), none (plain), prompt-lookup, ngram, suffix, a draft kind in the "
                          "bundle, or hybrid[:KIND] (lookup + that draft; chimera)."),
        click.option("--tree", default=None,
                     help="Tree name (tree8/16/32/64, chain4...) or JSON choices for the draft; default auto."),
        click.option("--backend", default="ort-cpu", show_default=True, type=BACKEND_CHOICE),
        click.option("--threads", default=None, type=click.IntRange(min=1),
                     help="Intra-op threads (default: all cores)."),
        click.option("--allow-inexact", is_flag=True,
                     help="LOSSY: speculate even where no step plan is bitwise exact on this machine "
                          "(output labelled lossy)."),
        click.option("--step-plan", default=None,
                     help="Take this step plan instead of the probe's choice, e.g. 'gathered' (trees exact by "
                          "construction); still probed, and refused where it is not exact (see validate). 'lone': "
                          "the fastest exact plan for one request at a time, whether or not its rows batch (answers "
                          "may then differ from a batching server's)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


# --- generate --------------------------------------------------------------------------------
