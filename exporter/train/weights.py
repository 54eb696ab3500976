"""Draft training: a generic resumable loop, shared training helpers, and the draft weights file.

The loop knows nothing about heads. A :class:`DraftTask` says what one example is, how a batch of
examples is built, the loss, and the held-out evaluation; the loop does AdamW with a cosine
schedule, progress bars, per-epoch evaluation (stdout and a JSON log) and checkpoints. Chimera's
task plugs into the same loop.

Checkpoints live in ``<out>.ckpt/``: each one is a directory ``step-XXXXXXXX/`` holding
``model.safetensors``, ``optim.safetensors`` and ``state.json``, written to a temporary name and
renamed, and ``latest.json`` (replaced atomically) names the newest. A rerun with the same settings
resumes from it automatically; the batch order is a pure function of (seed, epoch), so a resumed
run reaches the same weights as an uninterrupted one.

Draft weights (``.safetensors``) hold only the draft's own parameters (never the base lm_head) and
metadata tying them to the base model: its weight hash, hidden size and vocabulary size, the kind
and the head count. A file may store its matrices compactly (:mod:`.compact`, how the shipped drafts are
stored): int8 rows with one fp16 scale each, expanded to float32 on load.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from specdeploy.exporter.train.options import bf16_fast
from specdeploy.runtime.drafters.kinds import CHIMERA
from specdeploy.runtime.errors import DraftMismatchError, TrainingError

WEIGHTS_FORMAT = "specdeploy-draft"
WEIGHTS_VERSION = 1
SCALE_SUFFIX = "::row_scale"  # a compact matrix's per-row scales, stored beside its int8 values
VOCAB_ORDER_SIZE = 32768  # frequency-ordered token ids kept with the weights, for any trim <= this
TRIM_EVAL_SIZES = (4096, 8192, 16384)


# --- draft weights file -------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftWeights:
    """A loaded draft weights file: its config, tensors by prefix, and free-form metadata."""

    config: Any  # graphs.heads.HeadsConfig (or another kind's frozen config)
    tensors: dict[str, Any]  # name -> torch.Tensor, e.g. "heads.blocks.0.linear.weight", "vocab_order"
    meta: dict[str, Any]
    path: Path

    def prefixed(self, prefix: str) -> dict[str, Any]:
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    @property
    def vocab_trim(self) -> int:
        return int(self.meta.get("vocab_trim", 0))


def draft_weights_meta(cfg: Any, summary: dict[str, Any], cache: Any, **split: int) -> dict[str, Any]:
    """The metadata every trained draft's weights file records: training config and summary, and the
    data (the feature cache's size and build settings, plus the task's train/held-out ``split``)."""
    return {
        "vocab_trim": cfg.vocab_trim,
        "train": {**summary, "config": asdict(cfg)},
        "data": {"sequences": cache.num_sequences, "tokens": cache.num_tokens, **split,
                 "config": cache.meta["config"], "build_seconds": cache.meta.get("build_seconds")},
    }


def save_draft_weights(path: str | os.PathLike, config: Any, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write ``tensors`` (contiguous copies) and metadata atomically to ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "format": WEIGHTS_FORMAT,
        "version": str(WEIGHTS_VERSION),
        "config": json.dumps(asdict(config), sort_keys=True),
        "meta": json.dumps(meta, sort_keys=True),
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp), metadata=header)
        os.chmod(tmp, 0o644)  # a shippable file, readable like the rest of the package
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_draft_weights(path: str | os.PathLike, kind: str | None = None) -> DraftWeights:
    """Read a draft weights file; a missing, corrupt or foreign file, or another kind, gets one sentence."""
    from safetensors import safe_open
    from specdeploy.graphs.heads import HeadsConfig

    path = Path(path)
    if not path.is_file():
        raise DraftMismatchError(f"Draft weights file '{path}' does not exist.")
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open is not a dict
    except Exception as exc:  # noqa: BLE001 - safetensors raises several unrelated types for bad files
        raise DraftMismatchError(
            f"Draft weights file '{path}' is corrupt or not safetensors ({str(exc).splitlines()[0][:120]})."
        ) from None
    if header.get("format") != WEIGHTS_FORMAT:
        raise DraftMismatchError(f"'{path}' is a safetensors file but not a specdeploy draft (no draft metadata).")
    try:
        raw = json.loads(header["config"])
        meta = json.loads(header.get("meta", "{}"))
        if raw.get("kind") == CHIMERA:
            from specdeploy.graphs.chimera import ChimeraConfig

            config = ChimeraConfig(**raw)
        else:
            config = HeadsConfig(**raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise DraftMismatchError(f"Draft weights file '{path}' has malformed metadata ({exc}).") from None
    if kind is not None and config.kind != kind:
        raise DraftMismatchError(f"'{path}' holds a {config.kind} draft, not a {kind} draft.")
    return DraftWeights(config, _expanded(tensors), meta, path)


def _expanded(tensors: dict[str, Any]) -> dict[str, Any]:
    """Compact tensors back in their working form: int8 rows times their scales in float32, ids as int64."""
    import torch

    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is not None:
            t = t.float() * scale.float().unsqueeze(-1)
        elif t.dtype == torch.int32:
            t = t.long()
        out[name] = t
    return out


def check_draft_base(config: Any, weight_sha: str, hidden_size: int, vocab_size: int, where: str) -> None:
    """A draft trained for another base model (hidden size, vocabulary or weight hash) gets one sentence."""
    if config.hidden_size != hidden_size or config.vocab_size != vocab_size:
        raise DraftMismatchError(
            f"The {config.kind} draft was trained for a base with hidden size {config.hidden_size} and vocabulary "
            f"{config.vocab_size}, but {where} has {hidden_size} and {vocab_size}."
        )
    if config.base_weight_sha != weight_sha:
        raise DraftMismatchError(
            f"The {config.kind} draft was trained for another base model (weight hash "
            f"{config.base_weight_sha[:12]}, {where} has {weight_sha[:12]})."
        )


# --- the generic loop -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoopConfig:
    epochs: int = 3
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.05  # cosine decays to lr * this
    seed: int = 0
    ckpt_every: int = 100  # steps between checkpoints (one is also written at every epoch end)
    threads: int = 2
    device: str = "cpu"  # "cpu" or "cuda[:N]" (see resolve_device); a checkpoint resumes on either
    time_limit_s: float | None = None  # end the run (evaluated and saved) at the first step past this

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise TrainingError("Training needs epochs >= 1, batch size >= 1 and a positive learning rate.")
        if self.time_limit_s is not None and self.time_limit_s < 0:
            raise TrainingError("The training time limit must be >= 0 minutes.")




class DraftTask(ABC):
    """One kind of draft to train: examples, batches, loss and held-out evaluation.

    Every task runs on one device (:meth:`to`): its frozen tensors (named in ``device_tensors``) and its
    batches live there, and ``autocast`` takes its device type, so one code path serves CPU and GPU.
    """

    kind: str
    device: str = "cpu"
    device_tensors: tuple[str, ...] = ()
    bf16_setting: bool | None = None  # the config's ``bf16``: True/False force it, None where it is fast
    train_weight32 = None  # the loss's vocabulary projection, fp32; ``train_weight`` is it in the matmul dtype

    def to(self, device: str) -> DraftTask:
        """Move the frozen tensors to ``device`` (batches follow it)."""
        self.device = device
        for name in self.device_tensors:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        self.cast_projection()
        return self

    @property
    def bf16(self) -> bool:
        """Whether matmuls run under bf16 autocast (and the vocabulary projection is stored in bf16) here."""
        return bf16_fast(self.device_type) if self.bf16_setting is None else self.bf16_setting

    def cast_projection(self) -> None:
        if self.train_weight32 is not None:
            import torch

            self.train_weight = self.train_weight32.to(torch.bfloat16 if self.bf16 else torch.float32)

    @property
    def device_type(self) -> str:
        """``cuda`` or ``cpu``: what ``torch.autocast`` takes."""
        return self.device.split(":", 1)[0]

    @abstractmethod
    def build(self):
        """The trainable torch module (fresh, deterministic under the torch seed)."""

    @abstractmethod
    def num_examples(self) -> int:
        """Training examples per epoch; the loop shuffles indices ``0..n-1``."""

    @abstractmethod
    def loss(self, model, index: np.ndarray):
        """``(loss tensor, {name: float})`` for the examples ``index``."""

    @abstractmethod
    def evaluate(self, model, final: bool = False) -> dict[str, Any]:
        """Held-out metrics (JSON-serialisable); ``final`` may do a more thorough pass."""

    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """Everything that must match for a checkpoint to be resumed (data, model shape, settings)."""

    @abstractmethod
    def save(self, model, out: Path, summary: dict[str, Any]) -> None:
        """Write the final draft weights file."""


@dataclass
class TrainResult:
    out: Path
    steps: int
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)


def _lr_at(step: int, total: int, cfg: LoopConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cos)


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The batch order of an epoch: a pure function of (seed, epoch), so resuming reproduces it."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def train(task: DraftTask, out: str | os.PathLike, cfg: LoopConfig, resume: str = "auto",
          show_progress: bool = True, log: Callable[[str], None] | None = None,
          stop_after_steps: int | None = None) -> TrainResult:
    """Train ``task`` and write its weights to ``out``.

    ``resume``: "auto" continues a matching checkpoint if there is one, "require" insists on one,
    "restart" discards any. ``stop_after_steps`` ends the run early after a checkpoint (it simulates
    an interruption in tests); the weights file is then not written.
    """
    import torch
    from tqdm import tqdm

    log = log or (lambda m: print(m, flush=True))
    if resume not in ("auto", "require", "restart"):
        raise ValueError(resume)
    out = Path(out)
    torch.set_num_threads(max(1, cfg.threads))
    ckpt_dir = out.with_name(out.name + ".ckpt")
    fingerprint = {"task": task.fingerprint(), "loop": asdict(cfg)}
    fingerprint["loop"].pop("threads")
    fingerprint["loop"].pop("device")
    fingerprint["loop"].pop("time_limit_s")  # a resumed run may be given more (or less) time
    torch.manual_seed(cfg.seed)  # the initial weights are made on the CPU, the same for every device
    model = task.build().to(cfg.device)
    task.to(cfg.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    n = task.num_examples()
    steps_per_epoch = max(1, n // cfg.batch_size)  # the last partial batch is dropped
    total = steps_per_epoch * cfg.epochs
    step, history, elapsed = 0, [], 0.0

    if resume == "restart":
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    found = _latest_checkpoint(ckpt_dir)
    if found is None and resume == "require":
        raise TrainingError(f"There is no checkpoint to resume in '{ckpt_dir}'.")
    if found is not None:
        state = _load_checkpoint(found, model, opt, json.loads(json.dumps(fingerprint)))
        step, history, elapsed = int(state["step"]), list(state["history"]), float(state["elapsed"])
        log(f"resuming from step {step}/{total} ({found.name})")

    log_path = out.with_name(out.stem + ".train.json")
    t_start = time.time() - elapsed
    bar = tqdm(total=total, initial=step, desc=f"train {task.kind}", unit="step", disable=not show_progress)
    model.train()
    out_of_time = False
    while step < total and not out_of_time:
        epoch, within = divmod(step, steps_per_epoch)
        order = epoch_order(cfg.seed, epoch, n)
        for b in range(within, steps_per_epoch):
            index = order[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, total, cfg)
            loss, stats = task.loss(model, index)
            opt.zero_grad(set_to_none=True)
            if loss.requires_grad:  # a batch without one target position (none in the draft vocabulary) teaches nothing
                loss.backward()
                opt.step()
            step += 1
            loss_value = float(loss.detach())
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss_value:.3f}", **{k: f"{v:.3f}" for k, v in stats.items()})
            last_of_epoch = b == steps_per_epoch - 1
            if last_of_epoch:
                model.eval()
                metrics = task.evaluate(model)
                model.train()
                entry = {"epoch": epoch + 1, "step": step, "loss": loss_value,
                         "elapsed_s": round(time.time() - t_start, 1), **metrics}
                history.append(entry)
                log(f"epoch {epoch + 1}/{cfg.epochs}: " + _fmt_metrics(metrics))
                _write_json(log_path, {"kind": task.kind, "history": history, "fingerprint": fingerprint})
            if last_of_epoch or step % cfg.ckpt_every == 0 or step == stop_after_steps:
                _save_checkpoint(ckpt_dir, step, model, opt, {
                    "step": step, "history": history, "elapsed": time.time() - t_start, "fingerprint": fingerprint,
                })
            if stop_after_steps is not None and step >= stop_after_steps:
                bar.close()
                return TrainResult(out, step, time.time() - t_start, history)
            if cfg.time_limit_s is not None and time.time() - t_start >= cfg.time_limit_s:
                out_of_time = step < total
                break
    bar.close()
    seconds = time.time() - t_start
    if out_of_time:
        log(f"time limit reached at step {step}/{total} ({seconds / 60:.1f} min); evaluating and saving these weights")
    model.eval()
    final = task.evaluate(model, final=True)
    log("final held-out: " + _fmt_metrics(final))
    model.cpu()  # the weights file is written from the CPU
    task.to("cpu")
    summary = {"steps": step, "planned_steps": total, "train_seconds": round(seconds, 1), "history": history,
               "final": final, "loop": asdict(cfg)}
    task.save(model, out, summary)
    _write_json(log_path, {"kind": task.kind, "history": history, "final": final, "train_seconds": round(seconds, 1),
                           "fingerprint": fingerprint})
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return TrainResult(out, step, seconds, history, final)


def _fmt_metrics(metrics: dict[str, Any]) -> str:
    parts = []
    for k, v in metrics.items():
        if isinstance(v, list) and v and isinstance(v[0], float):
            parts.append(f"{k} " + " ".join(f"{x:.3f}" for x in v))
        elif isinstance(v, float):
            parts.append(f"{k} {v:.3f}")
    return "; ".join(parts)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _latest_checkpoint(ckpt_dir: Path) -> Path | None:
    latest = ckpt_dir / "latest.json"
    if not latest.is_file():
        return None
    try:
        name = json.loads(latest.read_text())["checkpoint"]
    except (ValueError, KeyError, TypeError):
        raise TrainingError(f"The checkpoint index '{latest}' is corrupt; pass --restart to start over.") from None
    path = ckpt_dir / str(name)
    if not path.is_dir():
        raise TrainingError(f"The checkpoint '{path}' named by '{latest}' is missing; pass --restart to start over.")
    return path


def _save_checkpoint(ckpt_dir: Path, step: int, model, opt, state: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=ckpt_dir))
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  str(tmp / "model.safetensors"))
        save_file(_optim_tensors(opt), str(tmp / "optim.safetensors"))
        (tmp / "state.json").write_text(json.dumps(state))
        final = ckpt_dir / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_json(ckpt_dir / "latest.json", {"checkpoint": name})
    for old in ckpt_dir.glob("step-*"):  # keep only the newest
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def _optim_tensors(opt) -> dict[str, Any]:
    """AdamW state as flat tensors ``"<param index>.<key>"`` (step counts included)."""
    import torch

    out = {}
    for pid, st in opt.state_dict()["state"].items():
        for key, val in st.items():
            out[f"{pid}.{key}"] = val.detach().cpu().contiguous() if torch.is_tensor(val) else torch.tensor(val)
    return out


def _load_checkpoint(path: Path, model, opt, fingerprint: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    try:
        state = json.loads((path / "state.json").read_text())
        same = state["fingerprint"] == fingerprint
    except Exception as exc:  # noqa: BLE001 - missing file, bad JSON, missing key: all mean corrupt
        raise TrainingError(f"The checkpoint '{path}' is corrupt ({exc}); pass --restart to start over.") from None
    if not same:
        raise TrainingError(
            f"The checkpoint in '{path.parent}' belongs to a run with other settings or data; "
            "pass --restart to discard it."
        )
    try:
        weights = load_file(str(path / "model.safetensors"))
        optim = load_file(str(path / "optim.safetensors"))
        model.load_state_dict(weights, strict=True)
        sd = opt.state_dict()
        per_param: dict[int, dict[str, Any]] = {}
        for name, val in optim.items():
            pid, key = name.split(".", 1)
            per_param.setdefault(int(pid), {})[key] = val
        sd["state"] = per_param
        opt.load_state_dict(sd)
        int(state["step"]), state["history"], float(state["elapsed"]), state["fingerprint"]
    except Exception as exc:  # noqa: BLE001 - json, safetensors and torch each raise their own types here
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise TrainingError(f"The checkpoint '{path}' is corrupt ({detail}); pass --restart to start over.") from None
    return state


def training_vocab(lm_weight, vocab_order: np.ndarray, trim: int):
    """``(vocab_order [<=32768], remap [V] or None, train_weight32)`` for a loss over the ``trim`` most useful ids.

    ``remap`` maps a full id to its row of the projection (-1: outside the draft vocabulary, skipped
    by the loss); ``trim`` 0 keeps the full shared lm_head. The projection is fp32 (see
    :meth:`DraftTask.cast_projection`).
    """
    import torch

    vocab = int(lm_weight.shape[0])
    order = torch.from_numpy(np.asarray(vocab_order)[: min(vocab, VOCAB_ORDER_SIZE)].astype(np.int64))
    remap, weight = None, lm_weight
    if trim:
        keep = order[:trim]
        remap = torch.full((vocab,), -1, dtype=torch.int64)
        remap[keep] = torch.arange(keep.numel())
        weight = lm_weight[keep]
    return order, remap, weight.float()


def load_checked_state(module, state: dict[str, Any], weights: DraftWeights, what: str):
    """Load ``state`` into ``module`` after checking every key and shape; a mismatch gets one sentence."""
    expected = module.state_dict()
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
        raise DraftMismatchError(
            f"Draft weights file '{weights.path}' does not match {what} (keys or shapes differ)."
        )
    module.load_state_dict(state, strict=True)
    return module.eval()
