"""One training run's config, end to end: the CLI builds it, the trainers read it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from specdeploy.exporter.train.data import DataConfig, data_config
from specdeploy.exporter.train.options import TrainDefaults
from specdeploy.exporter.train.weights import LoopConfig


@dataclass(frozen=True)
class TrainRun:
    """One training run as the CLI builds it (``TrainRun.with_defaults``), whatever the kind: the data it trains on,
    the draft's shape and the loop. The trainers (``run_heads_training``, ``run_chimera_training``) read it all
    from here; the per-kind defaults are :data:`HEADS_DEFAULTS` and :data:`CHIMERA_DEFAULTS`."""

    out: Path
    model: str | None
    heads: int
    epochs: int
    batch_size: int
    lr: float
    max_seqs: int
    vocab_trim: int
    replies: str
    max_len: int = 512
    reply_tokens: int = 256
    threads: int = 2
    seed: int = 0
    layers: int = 1  # Medusa/Cerberus: ResBlocks per head
    feature_weight: float = 0.1  # Chimera: weight of the hidden-state regression
    feature_layers: str | tuple[int, ...] = ()  # Chimera: base layers fused into its input (EAGLE-3)
    data_dir: Path | None = None
    device: str = "auto"
    engine: str | None = None  # make the data through this bundle's runtime
    replies_file: str | None = None
    time_limit: float | None = None  # minutes of training (the data is made first, without it)

    @classmethod
    def with_defaults(cls, defaults: TrainDefaults, out: str | Path, **options) -> TrainRun:
        """A run with ``defaults`` (a kind's), overridden by ``options`` (the CLI's, by name)."""
        base = {f.name: getattr(defaults, f.name) for f in fields(defaults)}
        return cls(out=Path(out), **{**base, **options})

    def loop(self, device: str, **settings) -> LoopConfig:
        """The training loop's config on ``device`` (the time limit in seconds)."""
        return LoopConfig(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, seed=self.seed,
                          threads=self.threads, device=device,
                          time_limit_s=None if self.time_limit is None else 60.0 * self.time_limit, **settings)

    def data(self, feature_layers: tuple[int, ...] = ()) -> DataConfig:
        """The training data's config."""
        return data_config(self.max_seqs, self.max_len, self.seed, self.replies, self.reply_tokens,
                           replies_file=self.replies_file, feature_layers=feature_layers)
