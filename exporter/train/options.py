"""Training options resolved against this machine and the base model: device, bf16 autocast, feature layers."""

from __future__ import annotations

from dataclasses import dataclass

from specdeploy.runtime.errors import TrainingError

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class TrainDefaults:
    """The defaults of one trainer: its ``run_*_training`` signature and its CLI options both read them."""

    heads: int
    epochs: int
    batch_size: int  # heads: positions per step; Chimera: sequences per step
    lr: float
    max_seqs: int
    vocab_trim: int
    replies: str  # "sharegpt" or "self"
    max_len: int = 512
    reply_tokens: int = 256
    threads: int = 2
    seed: int = 0


HEADS_DEFAULTS = TrainDefaults(heads=4, epochs=3, batch_size=256, lr=1e-3, max_seqs=256, vocab_trim=0,
                               replies="sharegpt")
CHIMERA_DEFAULTS = TrainDefaults(heads=4, epochs=6, batch_size=4, lr=1e-3, max_seqs=1024, vocab_trim=8192,
                                 replies="self")


def resolve_device(device: str | None = "auto") -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` without a GPU gets one sentence."""
    import torch

    name = (device or "auto").strip().lower()
    kind = name.split(":", 1)[0]
    if kind not in DEVICES or (":" in name and (kind != "cuda" or not name.split(":", 1)[1].isdigit())):
        raise TrainingError(f"Unknown training device '{device}'; choose auto, cpu or cuda (cuda:N for one GPU).")
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise TrainingError("Training on cuda was asked for, but torch sees no CUDA GPU on this machine.")
        index = int(name.split(":", 1)[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise TrainingError(f"Training on {name} was asked for, but torch sees {torch.cuda.device_count()} GPU(s).")
    return name


def resolve_feature_layers(value: str | tuple[int, ...] | None, base_config) -> tuple[int, ...]:
    """``--feature-layers`` for a base model: checked, with one sentence for a bad value."""
    from specdeploy.graphs.base_step import check_feature_layers
    from specdeploy.graphs.chimera import feature_layers_option

    n = int(base_config.num_hidden_layers)
    try:
        return check_feature_layers(feature_layers_option(value, n), n)
    except ValueError as exc:
        raise TrainingError(f"--feature-layers: {exc}.") from None


def bf16_fast(device_type: str) -> bool:
    """Whether bf16 matmuls are fast on this device: a CUDA GPU with bf16, or a CPU with AMX or AVX-512 BF16.

    Elsewhere torch emulates bf16, and autocast slows training down instead: a Chimera step under bf16
    autocast took over a minute on a 2-core AVX2 EPYC (about 2 s in fp32 there; 1.75 s in bf16 on AMX).
    """
    import torch

    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type == "cpu":
        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    return False
