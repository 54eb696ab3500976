"""EAGLE-3's low/mid/high feature fusion against today's Chimera input, trained side by side.

    python scripts/experiments/eagle3_features.py DATA_DIR OUT_DIR [--seqs 640] [--epochs 2]

DATA_DIR is a self-reply data cache made through the runtime (``specdeploy train data --engine ...``),
finished or still being made: the replies of its first ``--seqs`` sequences (whole shards) are taken
from its shards. The torch model derives their features once more, now with the residual states of
the tapped layers (``default_feature_layers``), into OUT_DIR/data. Two drafts then train on that one
cache with the same settings, steps and seed: ``plain`` (the real slots read the last hidden state, as
the shipped Chimera does) and ``fused`` (they read the fused taps). Held-out per-head top-1 and the
chain (teacher-forced tokens per step of a 4-deep chain) decide; OUT_DIR/result.json keeps all of it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from specdeploy.exporter.bench.report import machine_info
from specdeploy.exporter.source import load_model
from specdeploy.exporter.train.chimera import ChimeraTask, ChimeraTrainConfig
from specdeploy.exporter.train.data import build_cache, data_config, select_sequences, vocab_order
from specdeploy.exporter.train.selfdistill import replies_of, save_replies
from specdeploy.exporter.train.weights import LoopConfig, train
from specdeploy.graphs.chimera import default_feature_layers


def cpu_name() -> str:
    m = machine_info()
    return f"{m['cpu_model']} ({m['cpu_isa']})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--seqs", type=int, default=640)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(None)
    source = data_config(5120, 512, 0, "self", 256)  # the runtime cache's selection, in file order
    shard = source.shard_size
    n = args.seqs // shard * shard
    replies = replies_of(Path(args.data) / "shards", n // shard)
    if replies is None or len(replies) < n:
        raise SystemExit(f"{args.data} has fewer than {n} finished sequences")
    conv_ids = [c.id for c, _, _ in itertools.islice(select_sequences(loaded.tokenizer, source), n)]
    save_replies(out / "replies.npz", conv_ids, replies)
    taps = default_feature_layers(int(loaded.model.config.num_hidden_layers))
    config = data_config(n, 512, 0, "self", 256, replies_file=str(out / "replies.npz"), feature_layers=taps)
    cache = build_cache(loaded, out / "data", config)
    order = vocab_order(cache, loaded.tokenizer)
    m = loaded.model
    result = {"cpu": cpu_name(), "threads": args.threads, "sequences": n, "feature_layers": list(taps),
              "reply_positions": int(cache.assistant.sum()),
              "feature_pass_s": cache.meta["build_seconds"],  # when the cache was built (a rerun reuses it)
              "variants": {}}
    for name, layers in (("plain", ()), ("fused", taps)):
        cfg = ChimeraTrainConfig(feature_layers=layers)
        task = ChimeraTask(cache, m.model.embed_tokens.weight, m.lm_head.weight, m.model.norm.weight, m.config,
                           loaded.weight_sha, cfg, order)
        loop = LoopConfig(epochs=args.epochs, batch_size=4, lr=1e-3, seed=0, threads=args.threads, warmup_steps=20,
                          ckpt_every=25)
        t0 = time.time()
        res = train(task, out / f"{name}.safetensors", loop, log=print)
        final = json.loads((out / f"{name}.train.json").read_text())["final"]
        result["variants"][name] = {"train_s": round(time.time() - t0, 1), "steps": res.steps, **final}
        (out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"{'variant':8} {'top1 per head':32} {'chain':32} tau")
    for name, v in result["variants"].items():
        print(f"{name:8} {v['top1']!s:32} {v['chain']!s:32} {v['chain_tau']}")


if __name__ == "__main__":
    main()
