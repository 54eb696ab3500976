"""On a GPU: which step plans are exact, and what speculation gains under the padded-rows plan.

For each precision, eager and with CUDA graphs, over the real SmolLM2-135M shape with random weights:
probe the candidates 'one-graph' (1-row plain steps), 'two-rows' and 'padded-16' (every step 16 rows)
bit for bit; where 'padded-16' is exact, decode plain (1-row, 'one-graph') and plain and prompt lookup
under 'padded-16'; time the steps (median of 5 x 30); measure the copy bandwidth; name the attention
kernels one eager step launches. Writes one JSON (argument 1).

    python scripts/experiments/gpu_padded_probe.py out.json [--dry-run] [--precisions=fp16,bf16] [--graphs-only]
        [--num-prompts=N]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from specdeploy.exporter.bench.gpu import SMOLLM2_135M, TINY, Check, prompts, warm_clock
from specdeploy.exporter.bench.gpu_common import timed_decode
from specdeploy.runtime.drafters import PromptLookupDrafter
from specdeploy.runtime.plan import Candidate
from specdeploy.runtime.plan_choice import choose
from specdeploy.runtime.probe import probe


def main() -> None:
    out = Path(sys.argv[1])
    dry = "--dry-run" in sys.argv
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--precisions=")]
    graphs_only = "--graphs-only" in sys.argv
    count = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--num-prompts=")), "4"))
    cuda = torch.cuda.is_available() and not dry
    shape = TINY if dry else SMOLLM2_135M
    check = Check(shape, "cuda" if cuda else "cpu", max_context=1024 if cuda else 256, max_tree=64)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    res: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
    res["copy_bandwidth_bytes_per_s"] = warm_clock(3.0)["copy_bytes_per_s"] if cuda else None

    def save():
        out.write_text(json.dumps(res, indent=1, default=str))

    ids = prompts(shape, count, 64 if cuda else 24)
    max_new = 128 if cuda else 12
    for prec in (only[0].split(",") if only else ("fp32", "fp16", "bf16")) if cuda else ("fp32",):
        try:
            res.setdefault("attention_kernels", {})[prec] = check.attention_kernels(prec)
        except Exception as exc:  # noqa: BLE001 - the profiler is a nicety
            res.setdefault("attention_kernels", {})[prec] = [f"error: {exc}"]
        for graphs in ((True,) if graphs_only else (False, True)) if cuda else (False,):
            key = f"{prec}-{'graphs' if graphs else 'eager'}"
            entry = res.setdefault("modes", {})[key] = {}
            with check.backend(prec, graphs) as backend:
                backend.capture_all()
                entry["step_ms_median5"] = {str(t): check.step_ms(backend, t, 256 if cuda else 16, 30, repeats=5)
                                            for t in (1, 2, 4, 16)}
                verdicts = {}
                for cand in (Candidate("one-graph", False, 1), Candidate("two-rows", False, 2),
                             Candidate("padded-16", False, 16)):
                    r = probe(backend, check.manifest, cand, 16)
                    verdicts[cand.name] = r
                    entry.setdefault("probe", {})[cand.name] = {
                        "chains_exact": r.chains_exact, "trees_exact": r.trees_exact, "plain_ms": round(r.plain_ms, 3),
                        "checks": [(c.what, c.max_abs) for c in r.checks]}
                    save()
                one = choose([verdicts["one-graph"]], 16, allow_inexact=True)
                ar1 = timed_decode(check.manifest, backend, one, None, ids, max_new)
                entry["ar_1row_tok_s"] = ar1["tok_s"]
                pad = verdicts["padded-16"]
                plan = choose([pad], 16, allow_inexact=True)
                ar = timed_decode(check.manifest, backend, plan, None, ids, max_new)
                pl = timed_decode(check.manifest, backend, plan, PromptLookupDrafter(), ids, max_new)
                entry["padded16"] = {"plan": plan.reason, "exact": plan.exact, "ar_tok_s": ar["tok_s"],
                                     "prompt_lookup_tok_s": pl["tok_s"], "tau_random_weights": pl["tau"],
                                     "speedup_vs_padded_ar": round(pl["tok_s"] / ar["tok_s"], 3),
                                     "speedup_vs_1row_ar": round(pl["tok_s"] / ar1["tok_s"], 3),
                                     "identical_to_padded_plain": [a == b for a, b in zip(ar["tokens"], pl["tokens"])],
                                     "padded_plain_equals_1row_plain": [a == b for a, b in
                                                                        zip(ar["tokens"], ar1["tokens"])]}
                save()
    print(json.dumps(res, default=str)[:6000])


if __name__ == "__main__":
    main()
