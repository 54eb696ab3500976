"""Medusa and Cerberus heads: the training task, rebuilding heads from weights, and the train command.

Plugs into the generic loop of :mod:`.train`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from specdeploy.exporter.train.options import resolve_device
from specdeploy.exporter.train.run import TrainRun
from specdeploy.exporter.train.weights import (
    TRIM_EVAL_SIZES,
    VOCAB_ORDER_SIZE,
    DraftTask,
    TrainResult,
    draft_weights_meta,
    save_draft_weights,
    train,
    training_vocab,
)
from specdeploy.runtime.drafters.kinds import HEADS_KINDS
from specdeploy.runtime.errors import TrainingError


# --- Medusa / Cerberus heads ---------------------------------------------------------------------
@dataclass(frozen=True)
class HeadsTrainConfig:
    kind: str  # "medusa" | "cerberus"
    num_heads: int = 4
    layers: int = 1
    head_decay: float = 0.8  # loss weight of head k is head_decay**k (Medusa-1)
    vocab_trim: int = 0  # > 0: the loss (and the exported graph) use only the N most frequent label ids
    # The lm_head matmuls in bf16 (~4x on AMX; softmax and loss stay fp32); None: where bf16 is fast.
    bf16: bool | None = None
    assistant_only: bool = True  # train on positions inside assistant replies
    eval_positions: int = 4096  # held-out positions per epoch (all of them in the final evaluation)

    def __post_init__(self) -> None:
        if self.kind not in HEADS_KINDS:
            raise TrainingError(f"Unknown heads kind '{self.kind}'; choose medusa or cerberus.")
        if self.num_heads < 1 or self.num_heads > 8:
            raise TrainingError("The head count must be between 1 and 8.")
        if self.vocab_trim < 0 or self.vocab_trim > VOCAB_ORDER_SIZE:
            raise TrainingError(f"--vocab-trim must be 0 (full vocabulary) or at most {VOCAB_ORDER_SIZE}.")


class HeadsTask(DraftTask):
    """Self-distillation of K heads: head k at position t learns the base argmax ``labels[t+1+k]``."""

    device_tensors = ("lm_weight", "remap", "train_weight32", "weights")

    def __init__(self, cache, lm_weight, base_weight_sha: str, config: HeadsTrainConfig,
                 vocab_order: np.ndarray | None = None):
        import torch
        from specdeploy.graphs.heads import HeadsConfig

        self.kind = config.kind
        self.cache, self.cfg = cache, config
        vocab, hidden = int(lm_weight.shape[0]), int(lm_weight.shape[1])
        cache.check_base(base_weight_sha, hidden, vocab)
        self.heads_config = HeadsConfig(config.kind, config.num_heads, hidden, vocab, config.layers, base_weight_sha)
        self.lm_weight = lm_weight.detach().float()  # [V, H] frozen, shared with the base
        if vocab_order is None:  # most frequent training label first, ties by id
            vocab_order = np.lexsort((np.arange(vocab), -cache.label_counts(vocab)))
        self.bf16_setting = config.bf16
        self.vocab_order, self.remap, self.train_weight32 = training_vocab(self.lm_weight, vocab_order,
                                                                           config.vocab_trim)
        self.cast_projection()
        self.train_pos = cache.positions("train", config.assistant_only)
        self.heldout_pos = cache.positions("heldout", config.assistant_only)
        if self.train_pos.size == 0 or self.heldout_pos.size == 0:
            raise TrainingError("The training-data cache has no usable train or held-out positions.")
        self.weights = torch.tensor([config.head_decay**k for k in range(config.num_heads)])

    def build(self):
        from specdeploy.graphs.build import build_heads

        return build_heads(self.heads_config)

    def num_examples(self) -> int:
        return int(self.train_pos.size)

    def _batch(self, positions: np.ndarray):
        import torch

        hidden = np.asarray(self.cache.hidden[positions], dtype=np.float32)  # [B, H]
        labels, valid = self.cache.head_targets(positions, self.cfg.num_heads)  # [B, K] each
        return tuple(torch.from_numpy(a).to(self.device) for a in (hidden, labels, valid))

    def loss(self, model, index: np.ndarray):
        import torch
        import torch.nn.functional as F

        hidden, labels, valid = self._batch(np.sort(self.train_pos[index]))
        if self.remap is not None:
            labels = self.remap[labels]
            valid = valid & (labels >= 0)
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16 and self.device_type == "cuda"):
            z = model(hidden)  # [B, K, H]; on the CPU the heads stay fp32 (only the lm_head runs in bf16)
        logits = torch.matmul(z.to(self.train_weight.dtype), self.train_weight.t()).float()  # [B, K, V']
        ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
        ce = ce.view_as(labels) * valid  # [B, K]
        per_head = ce.sum(0) / valid.sum(0).clamp(min=1)  # [K]
        loss = (per_head * self.weights).sum()
        with torch.no_grad():
            top1 = ((logits.argmax(-1) == labels) & valid).sum(0) / valid.sum(0).clamp(min=1)
        return loss, {"acc0": float(top1[0]), f"acc{self.cfg.num_heads - 1}": float(top1[-1])}

    def evaluate(self, model, final: bool = False) -> dict[str, Any]:
        """Held-out per-head top-1 (full lm_head), top-5/top-10, and top-1 with trimmed vocabularies."""
        import torch

        pos = self.heldout_pos
        if not final and pos.size > self.cfg.eval_positions:
            pos = np.sort(np.random.default_rng(0).choice(pos, self.cfg.eval_positions, replace=False))
        k = self.cfg.num_heads
        hits = {"top1": np.zeros(k), "top5": np.zeros(k), "top10": np.zeros(k)}
        trims = [t for t in TRIM_EVAL_SIZES if t < self.heads_config.vocab_size]
        trim_hits = {t: np.zeros(k) for t in trims}
        in_trim = {}
        for t in trims:
            mask = torch.zeros(self.heads_config.vocab_size, dtype=torch.bool, device=self.device)
            mask[self.vocab_order[:t]] = True
            in_trim[t] = mask
        count = np.zeros(k)
        weight = self.lm_weight if final else self.lm_weight.to(torch.bfloat16)
        with torch.no_grad():
            for a in range(0, pos.size, 512):
                hidden, labels, valid = self._batch(pos[a : a + 512])
                logits = torch.matmul(model(hidden).to(weight.dtype), weight.t()).float()  # [B, K, V]
                label_logit = logits.gather(-1, labels.unsqueeze(-1))  # [B, K, 1]
                rank = (logits > label_logit).sum(-1)  # [B, K]: 0 means top-1
                v = valid.cpu().numpy()
                count += v.sum(0)
                for name, r in (("top1", 1), ("top5", 5), ("top10", 10)):
                    hits[name] += ((rank < r).cpu().numpy() & v).sum(0)
                for t in trims:
                    masked = logits.masked_fill(~in_trim[t], float("-inf"))
                    hits_t = (masked.argmax(-1) == labels).cpu().numpy() & v
                    trim_hits[t] += hits_t.sum(0)
        out: dict[str, Any] = {name: (h / np.maximum(count, 1)).round(4).tolist() for name, h in hits.items()}
        for t in trims:
            out[f"top1_trim{t}"] = (trim_hits[t] / np.maximum(count, 1)).round(4).tolist()
        out["heldout_positions"] = int(count[0])
        return out

    def fingerprint(self) -> dict[str, Any]:
        return {"heads": asdict(self.heads_config), "train": asdict(self.cfg), "data": self.cache.meta["config"],
                "data_tokens": self.cache.num_tokens}

    def save(self, model, out: Path, summary: dict[str, Any]) -> None:
        tensors = {f"heads.{k}": v for k, v in model.state_dict().items()}
        tensors["vocab_order"] = self.vocab_order.to(dtype=self.vocab_order.dtype)
        meta = draft_weights_meta(self.cfg, summary, self.cache, train_positions=int(self.train_pos.size),
                                  heldout_positions=int(self.heldout_pos.size))
        save_draft_weights(out, self.heads_config, tensors, meta)


def run_heads_training(kind: str, run: TrainRun, resume: str = "auto", show_progress: bool = True,
                       log: Callable[[str], None] | None = None) -> TrainResult:
    """``specdeploy train medusa|cerberus``: cache the data and train (calibration is a separate step).

    ``run.time_limit`` (minutes) caps the training, not the data: the run then stops, evaluates and saves."""
    import torch
    from specdeploy.exporter.source import load_model
    from specdeploy.exporter.train.data import training_cache, vocab_order

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    device = resolve_device(run.device)  # before any slow step: a missing GPU is said at once
    heads_cfg = HeadsTrainConfig(kind, num_heads=run.heads, layers=run.layers, vocab_trim=run.vocab_trim)
    loop = run.loop(device)
    torch.set_num_threads(max(1, run.threads))
    log("loading the base model ...")
    loaded = load_model(run.model)
    cache = training_cache(loaded, run.data(), run.data_dir, run.engine, threads=run.threads,
                           show_progress=show_progress, device=device, log=log)
    order = vocab_order(cache, loaded.tokenizer)
    task = HeadsTask(cache, loaded.model.lm_head.weight, loaded.weight_sha, heads_cfg, order)
    result = train(task, run.out, loop, resume=resume, show_progress=show_progress, log=log)
    log(f"wrote {run.out} ({result.steps} steps, {result.seconds:.0f} s)")
    return result
