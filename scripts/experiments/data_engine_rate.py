"""Reply positions per hour of the two self-distillation data engines, on this machine.

    python scripts/experiments/data_engine_rate.py runtime BUNDLE OUT_DIR [--seqs 64]
    python scripts/experiments/data_engine_rate.py torch - OUT_DIR [--seqs 64]

Run each engine in its own process (torch and ONNX Runtime thread pools must not share one). Both
build the same data config (ShareGPT first turns, greedy self replies of up to 256 tokens, shards of
32 sequences) into OUT_DIR and print the cache's meta: positions, seconds, positions per hour.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace

from specdeploy.exporter.bench.report import machine_info
from specdeploy.exporter.source import load_model
from specdeploy.exporter.train.data import build_cache, data_config
from specdeploy.exporter.train.selfdistill import RuntimeGenerator


def cpu_name() -> str:
    m = machine_info()
    return f"{m['cpu_model']} ({m['cpu_isa']})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=["runtime", "torch"])
    ap.add_argument("bundle")
    ap.add_argument("out")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    loaded = load_model(None)
    config = data_config(args.seqs, 512, 0, "self", 256)
    generator = None
    if args.engine == "runtime":
        generator = RuntimeGenerator(args.bundle, threads=args.threads)
        config = replace(config, engine=generator.description)
    cache = build_cache(loaded, args.out, config, threads=args.threads, generator=generator)
    m = cache.meta
    print(json.dumps({"engine": m["engine"], "cpu": cpu_name(), "threads": args.threads, "sequences": m["num_sequences"],
                      "reply_positions": m["reply_positions"], "build_seconds": m["build_seconds"],
                      "positions_per_hour": m["positions_per_hour"]}))


if __name__ == "__main__":
    main()
