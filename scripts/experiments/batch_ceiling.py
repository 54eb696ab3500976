"""How fast continuous batching could be on this CPU: the cost per token of batched steps and of prefill.

    python scripts/experiments/batch_ceiling.py BUNDLE [--clients 32] [--max-new-tokens 128] [--baseline TOKS]

Times plain steps of B rows (B = 1..32, past 200, capacity 320) and prefills of T tokens on the bundle's
batching graph (``BundleManifest.batch_graph``), 2 threads, median of 7 (prefills: 3). Then, from the
chat-templated lengths of the first ``--clients`` MT-bench prompts, the ceiling of ``--clients`` clients
× ``--max-new-tokens``: every prompt prefilled once and every token decoded in a full batch of B rows,
with no scheduling cost at all. With ``--baseline`` (the ``--max-batch 1`` server's tok/s in a
bench-serve run), prints the ceiling as a ratio to it. Writes the figures as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from specdeploy.exporter.bench.run import default_prompts_file, read_prompts
from specdeploy.runtime import load
from specdeploy.runtime.backends.base import StepInputs
from specdeploy.runtime.backends.ort import OrtBackend
from specdeploy.runtime.bundle import read_manifest


def _inputs(b: int, t: int, cap: int, past: int) -> StepInputs:
    neg = np.finfo(np.float32).min
    mask = np.full((b, 1, t, cap), neg, np.float32)
    mask[..., :past] = 0.0
    mask[:, 0, :, past : past + t] = np.where(np.tril(np.ones((t, t), dtype=bool)), 0.0, neg)
    pos = np.repeat((past + np.arange(t))[None], b, 0).astype(np.int64)
    return StepInputs(np.full((b, t), 100, np.int64), pos, mask, np.arange(past, past + t, dtype=np.int64),
                      np.array([t - 1], dtype=np.int64))


def _median_ms(backend: OrtBackend, b: int, t: int, cap: int, past: int, rounds: int) -> float:
    backend.forget_buffers()
    cache, inp = backend.new_cache(b, cap), _inputs(b, t, cap, past)
    backend.step(inp, cache)  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        backend.step(inp, cache)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--baseline", type=float, default=None, help="the --max-batch 1 server's tok/s")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    manifest = read_manifest(args.bundle)
    graph = manifest.batch_graph()
    if graph is None:
        raise SystemExit(f"{args.bundle} has no batching graph; re-export its base.")
    backend = OrtBackend(args.bundle, manifest, provider="cpu", threads=2, graph=graph)
    steps = {}
    for b in (1, 2, 4, 8, 16, 24, 32):
        ms = _median_ms(backend, b, 1, 320, 200, 7)
        steps[b] = ms
        print(f"step B={b:2d}: {ms:6.1f} ms, {ms / b:5.2f} ms per token", flush=True)
    prefills = {}
    for t in (32, 64, 128):
        ms = _median_ms(backend, 1, t, t + 64, 0, 3)
        prefills[t] = ms
        print(f"prefill T={t:3d}: {ms:6.1f} ms, {ms / t:5.2f} ms per token", flush=True)

    with load(args.bundle, draft=None, threads=1) as engine:  # the tokenizer and chat template only
        lengths = [len(engine.encode(messages=[{"role": "user", "content": p}]))
                   for p in read_prompts(default_prompts_file())[: args.clients]]
    prefill_s = sum(np.interp(n, list(prefills), [prefills[t] / t for t in prefills]) * n for n in lengths) / 1000
    tokens = args.clients * args.max_new_tokens
    report = {"step_ms": steps, "prefill_ms": prefills, "prompt_tokens_mean": float(np.mean(lengths)),
              "prefill_s": prefill_s, "ceilings": {}}
    print(f"{args.clients} prompts: {np.mean(lengths):.0f} tokens on average, {prefill_s:.1f} s of prefill")
    for b in (16, 32):
        wall = prefill_s + tokens * steps[b] / b / 1000
        ceiling = {"wall_s": wall, "tokens_per_s": tokens / wall}
        line = f"ceiling at B={b}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s"
        if args.baseline:
            ceiling["vs_baseline"] = tokens / wall / args.baseline
            line += f" = {ceiling['vs_baseline']:.2f}x the baseline {args.baseline}"
        report["ceilings"][b] = ceiling
        print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
