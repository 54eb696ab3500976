"""``specdeploy train chimera``: self-distil a Chimera draft on cached ShareGPT base features.

The base model is frozen and never rerun: the shared cache (:mod:`.train_data`) holds, per position,
the token id, the base's last hidden state (fp16) and the base's own argmax. One example is one
ShareGPT sequence; :meth:`ChimeraDraft.unrolled` drafts ``num_heads`` steps deep from every origin
at once, exactly as decoding does (the unit tests check that equivalence against the exported step).

Loss at origin i and depth d (1-based), on positions whose target token lies in an assistant reply:

* cross-entropy of head d against the base's argmax ``labels[i+d]`` (self-distillation), over the
  trimmed draft vocabulary (labels outside it are skipped), weighted ``head_decay**(d-1)``;
* plus ``feature_weight`` x smooth-L1 between the draft feature ``f_{i+d}`` and the true ``h_{i+d}``
  (Chimera's and EAGLE's feature regression).

Held-out evaluation reports per-head top-1 with the full shared lm_head and with the trimmed
vocabulary, and the *chain* accuracy: the fraction of origins where heads 1..d are all right, whose
sum plus one is the tokens per step a chain draft would reach on teacher-forced text.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from specdeploy.exporter.train.options import resolve_device, resolve_feature_layers
from specdeploy.exporter.train.run import TrainRun
from specdeploy.exporter.train.weights import (
    VOCAB_ORDER_SIZE,
    DraftTask,
    TrainResult,
    draft_weights_meta,
    save_draft_weights,
    train,
    training_vocab,
)
from specdeploy.runtime.drafters.kinds import CHIMERA
from specdeploy.runtime.errors import TrainingError


@dataclass(frozen=True)
class ChimeraTrainConfig:
    num_heads: int = 4
    vocab_trim: int = 8192  # loss (and default export) over the N most useful ids; 0 = the full lm_head
    head_decay: float = 0.8
    feature_weight: float = 0.1  # smooth-L1 feature regression; 0 turns it off
    # Autocast the draft's matmuls to bf16 (loss, softmax and norms stay fp32); None: where bf16 is fast.
    bf16: bool | None = None
    min_len: int = 16
    eval_sequences: int = 48  # held-out sequences per epoch (all of them in the final evaluation)
    feature_layers: tuple[int, ...] = ()  # base layers fused into the real slots (EAGLE-3); () = last hidden

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if not 1 <= self.num_heads <= 8:
            raise TrainingError("The Chimera head count must be between 1 and 8.")
        if self.vocab_trim < 0 or self.vocab_trim > VOCAB_ORDER_SIZE:
            raise TrainingError(f"--vocab-trim must be 0 (full vocabulary) or at most {VOCAB_ORDER_SIZE}.")
        if self.feature_weight < 0:
            raise TrainingError("--feature-weight must be >= 0.")


class ChimeraTask(DraftTask):
    kind = CHIMERA
    device_tensors = ("embed", "lm_weight", "final_norm", "remap", "train_weight32")

    def __init__(self, cache, embed_weight, lm_weight, final_norm_weight, base_config, base_weight_sha: str,
                 config: ChimeraTrainConfig, vocab_order: np.ndarray):
        from specdeploy.graphs.chimera import ChimeraConfig

        vocab, hidden = int(lm_weight.shape[0]), int(lm_weight.shape[1])
        cache.check_base(base_weight_sha, hidden, vocab)
        self.cache, self.cfg = cache, config
        self.chimera_config = ChimeraConfig.for_base(base_config, config.num_heads, base_weight_sha,
                                                     config.feature_layers)
        cached = tuple(cache.meta["config"].get("feature_layers") or ())
        if config.feature_layers and cached != config.feature_layers:
            raise TrainingError(f"This draft fuses base layers {list(config.feature_layers)}, but the training-data "
                                f"cache holds {list(cached) or 'none'}; build the data with the same --feature-layers.")
        self.embed = embed_weight.detach().float()
        self.lm_weight = lm_weight.detach().float()
        self.final_norm = final_norm_weight.detach().float()
        self.bf16_setting = config.bf16
        self.vocab_order, self.remap, self.train_weight32 = training_vocab(self.lm_weight, vocab_order,
                                                                           config.vocab_trim)
        self.cast_projection()
        lengths = np.diff(cache.offsets)
        ok = lengths >= config.min_len
        self.train_seqs = np.flatnonzero(~cache.heldout & ok)
        self.heldout_seqs = np.flatnonzero(cache.heldout & ok)
        if self.train_seqs.size == 0 or self.heldout_seqs.size == 0:
            raise TrainingError("The training-data cache has no usable train or held-out sequences.")
        self.decay = [config.head_decay**d for d in range(config.num_heads)]

    def build(self):
        import torch
        from specdeploy.graphs.chimera import ChimeraDraft

        model = ChimeraDraft(self.chimera_config)
        with torch.no_grad():
            model.out_norm.copy_(self.final_norm)  # features live in the base's post-norm space
        return model

    def num_examples(self) -> int:
        return int(self.train_seqs.size)

    def _batch(self, seqs: np.ndarray):
        """Padded ``tokens, hidden, labels, assistant [B, L(, H)]``, ``lengths [B]`` and (fusing drafts) the
        tapped ``layers [B, L, taps*H]`` of sequences ``seqs``."""
        import torch

        c = self.cache
        spans = [(int(c.offsets[s]), int(c.offsets[s + 1])) for s in seqs]
        length = max(b - a for a, b in spans)
        h = self.chimera_config.hidden_size
        tokens = np.zeros((len(spans), length), dtype=np.int64)
        labels = np.zeros((len(spans), length), dtype=np.int64)
        assistant = np.zeros((len(spans), length), dtype=bool)
        hidden = np.zeros((len(spans), length, h), dtype=np.float32)
        fused = self.cfg.feature_layers
        layers = np.zeros((len(spans), length, len(fused) * h), dtype=np.float32) if fused else None
        for r, (a, b) in enumerate(spans):
            tokens[r, : b - a] = c.tokens[a:b]
            labels[r, : b - a] = c.labels[a:b]
            assistant[r, : b - a] = c.assistant[a:b] == 1
            hidden[r, : b - a] = c.hidden[a:b]
            if fused:
                layers[r, : b - a] = c.layers[a:b]
        lengths = np.asarray([b - a for a, b in spans])
        arrays = (tokens, hidden, labels, assistant, lengths) + ((layers,) if fused else ())
        return tuple(torch.from_numpy(a).to(self.device) for a in arrays)

    def _targets(self, d: int, labels, assistant, lengths):
        """Rows valid at depth d (1-based): origin i needs token i+d+1 inside the sequence and in a reply."""
        import torch

        length = labels.shape[1]
        i = torch.arange(length, device=labels.device)
        tgt = (i + d + 1).clamp(max=length - 1)
        valid = ((i + d + 1)[None, :] < lengths[:, None]) & assistant[:, tgt]
        lab = labels[:, (i + d).clamp(max=length - 1)]
        return valid, lab, (i + d).clamp(max=length - 1)

    def _forward(self, model, seqs: np.ndarray):
        import torch

        tokens, hidden, labels, assistant, lengths, *layers = self._batch(seqs)
        emb = self.embed[tokens]
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
            feats = model.unrolled(emb, hidden, self.cfg.num_heads, layers[0] if layers else None)
        return feats, hidden, labels, assistant, lengths

    def loss(self, model, index: np.ndarray):
        import torch
        import torch.nn.functional as F

        feats, hidden, labels, assistant, lengths = self._forward(model, self.train_seqs[np.sort(index)])
        total = torch.zeros((), device=self.device)
        stats: dict[str, float] = {}
        for d in range(1, self.cfg.num_heads + 1):
            valid, lab, feat_pos = self._targets(d, labels, assistant, lengths)
            if self.remap is not None:
                lab = self.remap[lab]
                keep = valid & (lab >= 0)
            else:
                keep = valid
            if not bool(keep.any()):
                continue
            f = feats[d - 1][keep].float()  # [N, H]
            base_h = hidden[keep]  # h_i, the heads' residual input
            with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
                z = model.head(base_h, f, d - 1)
            logits = torch.matmul(z.to(self.train_weight.dtype), self.train_weight.t()).float()
            ce = F.cross_entropy(logits, lab[keep])
            total = total + self.decay[d - 1] * ce
            if self.cfg.feature_weight:
                target = hidden[:, feat_pos][keep]
                total = total + self.cfg.feature_weight * self.decay[d - 1] * F.smooth_l1_loss(f, target)
            if d in (1, self.cfg.num_heads):
                with torch.no_grad():
                    stats[f"acc{d}"] = float((logits.argmax(-1) == lab[keep]).float().mean())
        return total, stats

    def evaluate(self, model, final: bool = False) -> dict[str, Any]:
        """Held-out per-head top-1 (full lm_head and trimmed), top-5, and chain accuracy."""
        import torch

        seqs = self.heldout_seqs
        if not final and seqs.size > self.cfg.eval_sequences:
            seqs = np.sort(np.random.default_rng(0).choice(seqs, self.cfg.eval_sequences, replace=False))
        k = self.cfg.num_heads
        hit1, hit5, hit_trim, count = np.zeros(k), np.zeros(k), np.zeros(k), np.zeros(k)
        chain_hits, chain_count = np.zeros(k), 0
        in_trim = None
        if self.cfg.vocab_trim:
            in_trim = torch.zeros(self.lm_weight.shape[0], dtype=torch.bool, device=self.device)
            in_trim[self.vocab_order[: self.cfg.vocab_trim]] = True
        with torch.no_grad():
            for a in range(0, seqs.size, 8):
                feats, hidden, labels, assistant, lengths = self._forward(model, seqs[a : a + 8])
                all_valid = None
                correct = []
                for d in range(1, k + 1):
                    valid, lab, _ = self._targets(d, labels, assistant, lengths)
                    z = model.head(hidden, feats[d - 1].float(), d - 1)  # [B, L, H]
                    logits = torch.matmul(z, self.lm_weight.t())  # [B, L, V]
                    label_logit = logits.gather(-1, lab.unsqueeze(-1))
                    rank = (logits > label_logit).sum(-1)
                    ok = (rank == 0) & valid
                    hit1[d - 1] += float(ok.sum())
                    hit5[d - 1] += float(((rank < 5) & valid).sum())
                    count[d - 1] += float(valid.sum())
                    if in_trim is not None:
                        trimmed = logits.masked_fill(~in_trim, float("-inf")).argmax(-1)
                        hit_trim[d - 1] += float(((trimmed == lab) & valid).sum())
                    correct.append(rank == 0)
                    all_valid = valid if all_valid is None else all_valid & valid
                run = torch.ones_like(all_valid)
                for d in range(k):
                    run = run & correct[d]
                    chain_hits[d] += float((run & all_valid).sum())
                chain_count += int(all_valid.sum())
        n = np.maximum(count, 1)
        chain = chain_hits / max(chain_count, 1)
        out: dict[str, Any] = {"top1": (hit1 / n).round(4).tolist(), "top5": (hit5 / n).round(4).tolist()}
        if in_trim is not None:
            out[f"top1_trim{self.cfg.vocab_trim}"] = (hit_trim / n).round(4).tolist()
        out["chain"] = chain.round(4).tolist()
        out["chain_tau"] = round(float(1.0 + chain.sum()), 3)
        out["heldout_positions"] = int(count[0])
        return out

    def fingerprint(self) -> dict[str, Any]:
        return {CHIMERA: asdict(self.chimera_config), "train": asdict(self.cfg), "data": self.cache.meta["config"],
                "data_tokens": self.cache.num_tokens}

    def save(self, model, out: Path, summary: dict[str, Any]) -> None:
        import torch

        # fp16 storage keeps the file under 30 MB; the exporter and the drafter compute in fp32
        tensors = {f"chimera.{k}": v.to(torch.float16) for k, v in model.state_dict().items()}
        tensors["vocab_order"] = self.vocab_order
        meta = draft_weights_meta(self.cfg, summary, self.cache, train_sequences=int(self.train_seqs.size),
                                  heldout_sequences=int(self.heldout_seqs.size))
        save_draft_weights(out, self.chimera_config, tensors, meta)


def run_chimera_training(kind: str, run: TrainRun, resume: str = "auto", show_progress: bool = True,
                         log: Callable[[str], None] | None = None) -> TrainResult:
    """Cache the base features (once), then train a Chimera (``kind``); resumes from the last checkpoint
    automatically. ``run.time_limit`` (minutes) caps the training, not the data: the run then stops,
    evaluates and saves."""
    import torch
    from specdeploy.exporter.source import load_model
    from specdeploy.exporter.train.data import training_cache, vocab_order

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    device = resolve_device(run.device)  # before any slow step: a missing GPU is said at once
    cfg = ChimeraTrainConfig(num_heads=run.heads, vocab_trim=run.vocab_trim, feature_weight=run.feature_weight)
    loop = run.loop(device, warmup_steps=20, ckpt_every=25)
    torch.set_num_threads(max(1, run.threads))
    log("loading the base model ...")
    loaded = load_model(run.model)
    taps = resolve_feature_layers(run.feature_layers, loaded.model.config)
    cfg = replace(cfg, feature_layers=taps)  # --feature-layers needs the base's depth
    cache = training_cache(loaded, run.data(taps), run.data_dir, run.engine, threads=run.threads,
                           show_progress=show_progress, device=device, log=log)
    order = vocab_order(cache, loaded.tokenizer)
    m = loaded.model
    task = ChimeraTask(cache, m.model.embed_tokens.weight, m.lm_head.weight, m.model.norm.weight, m.config,
                       loaded.weight_sha, cfg, order)
    result = train(task, run.out, loop, resume=resume, show_progress=show_progress, log=log)
    log(f"wrote {run.out} ({result.steps} steps, {result.seconds:.0f} s)")
    return result
