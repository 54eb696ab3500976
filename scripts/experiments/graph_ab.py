"""Two bundles' plain decoding step time, side by side in one process: a graph form against another.

    python scripts/experiments/graph_ab.py BUNDLE_A BUNDLE_B [--rounds 16] [--max-new-tokens 96] [--threads 2]

Both bundles are loaded (each with its step plan), then each round decodes one random prompt of 30 to
250 tokens greedily on A and on B, alternating which goes first, so that the machine's drift (which
moves step times by 25% over minutes on a shared 2-core VM) falls on both alike. Prints each round's
ms per decode step and the median ratio B/A. The two engines' thread pools take turns and never run
at once; both spin as the runtime's own do. Used for the q4_1 block-sum form (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse

import numpy as np
from specdeploy.runtime import load
from specdeploy.runtime.decode import DecodeStats, GenerationConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle_a")
    ap.add_argument("bundle_b")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engines = {"A": load(args.bundle_a, threads=args.threads), "B": load(args.bundle_b, threads=args.threads)}
    vocab = engines["A"].manifest.model.vocab_size
    rng = np.random.default_rng(0)
    ms: dict[str, list[float]] = {"A": [], "B": []}
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for r in range(args.rounds):
        prompt = rng.integers(100, vocab, int(rng.integers(30, 250))).tolist()
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            st = DecodeStats()
            list(engines[name].decoder.generate(prompt, config, st))
            ms[name].append(st.decode_s / max(st.steps, 1) * 1e3)
        print(f"round {r + 1:2d}: A {ms['A'][-1]:6.2f} ms/step  B {ms['B'][-1]:6.2f} ms/step", flush=True)
    ratio = np.array(ms["B"]) / np.array(ms["A"])
    print(f"median ms/step: A {np.median(ms['A']):.2f}, B {np.median(ms['B']):.2f}; "
          f"B/A median {np.median(ratio):.3f} (rounds with B faster: {int((ratio < 1).sum())}/{len(ratio)})")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
