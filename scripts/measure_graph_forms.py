"""Measure the forms of the base step graph against each other on ONNX Runtime CPU.

    python scripts/measure_graph_forms.py [--model M] [--past 256] [--threads 2] [--json OUT]

Forms (all of the same model, same inputs and outputs):

- ``inplace``: the traced ``trt`` target, ScatterElements into a capacity-C cache, present aliased to past;
- ``concat``: the traced plain concatenating form, past [B,H,P,D] -> present [B,H,P+T,D];
- ``contrib``: the ``ort`` target (``exporter/ort_graph.py``) with ONNX Runtime's fused contrib ops;
- ``std``: the same op-by-op graph in standard opset-24 ops (Attention, RotaryEmbedding, TensorScatter);
- ``gguf``: ``contrib`` with the source GGUF's own Q4_1 blocks as weights (``exporter/gguf_blocks.py``).

The traced forms take ~80 s each to export for SmolLM2, the op-by-op ones a few seconds. Each timing
runs in its own process (a 1-token step and a 16-node tree step), interleaved over rounds; the
median of the rounds' medians is reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TIMER = r"""
import json, sys, time
import numpy as np, onnxruntime as ort
path, form, P, T, C, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
so = ort.SessionOptions(); so.intra_op_num_threads = threads; so.inter_op_num_threads = 1
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
ins = {i.name: i for i in sess.get_inputs()}
L = sum(1 for n in ins if n.startswith("past_key_"))
H, D = ins["past_key_0"].shape[1], ins["past_key_0"].shape[3]
neg = np.finfo(np.float32).min
cap = C if form == "inplace" else P
past = [np.random.randn(1, H, cap, D).astype(np.float32) for _ in range(2 * L)]
width = C if form == "inplace" else P + T
mask = np.full((1, 1, T, width), neg, np.float32); mask[..., : P] = 0
for j in range(T): mask[0, 0, j, P : P + j + 1] = 0
feeds = {"input_ids": np.full((1, T), 42, np.int64), "position_ids": (P + np.arange(T))[None].astype(np.int64),
         "attention_mask": mask, "logits_index": np.arange(T, dtype=np.int64)}
if "write_indices" in ins: feeds["write_indices"] = (P + np.arange(T)).astype(np.int64)
b = sess.io_binding()
for k, v in feeds.items(): b.bind_cpu_input(k, v)
b.bind_output("logits"); b.bind_output("hidden_states")
vals = [ort.OrtValue.ortvalue_from_numpy(p) for p in past]
for i in range(L):
    for j, kind in enumerate(("key", "value")):
        ov = vals[2 * i + j]
        b.bind_ortvalue_input(f"past_{kind}_{i}", ov)
        if form == "inplace": b.bind_ortvalue_output(f"present_{kind}_{i}", ov)
        else: b.bind_output(f"present_{kind}_{i}")
for _ in range(3): sess.run_with_iobinding(b)
times = []
for _ in range(15):
    t = time.perf_counter(); sess.run_with_iobinding(b); times.append(time.perf_counter() - t)
print(json.dumps({"ms": 1000 * float(np.median(times))}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forms", default="inplace,concat,contrib,std,gguf")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    forms = args.forms.split(",")

    from specdeploy.exporter.source import load_model

    hf = load_model(args.model).model
    tmp = Path(tempfile.mkdtemp(prefix="graphforms-"))
    try:
        measure(hf, tmp, forms, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(hf, tmp: Path, forms: list[str], args: argparse.Namespace) -> None:
    import torch
    from specdeploy.exporter.export.ort_graph import export_ort_graph
    from specdeploy.exporter.export.staging import export_graph
    from specdeploy.graphs.base_step import BaseStep, example_inputs
    from torch.export import Dim

    paths = {}
    for form in forms:
        print(f"exporting the {form} form ...", file=sys.stderr, flush=True)
        if form == "gguf":
            from specdeploy.exporter.export.gguf_blocks import read_q4_1_linears
            from specdeploy.exporter.source import resolve_model_path

            blocks = read_q4_1_linears(resolve_model_path(args.model), hf)
            if blocks is None:
                print("skipping gguf: the model is not a Q4_1 GGUF", file=sys.stderr)
                continue
            export_ort_graph(BaseStep(hf).eval(), tmp / "gguf.onnx", args.past + 512, "contrib", blocks=blocks)
            paths[form] = tmp / "gguf.onnx"
            continue
        if form in ("contrib", "std"):
            export_ort_graph(BaseStep(hf).eval(), tmp / f"{form}.onnx", args.past + 512, form)
            paths[form] = tmp / f"{form}.onnx"
            continue
        step = BaseStep(hf, kv_form=form).eval()
        ex = example_inputs(step)
        batch, tree, cap, kept = (Dim(n) for n in ("batch", "tree", "capacity", "kept"))
        mask_last = cap if form == "inplace" else Dim.AUTO
        names = ["input_ids", "position_ids", "attention_mask", "write_indices", "logits_index", *step.past_names()]
        axes = {"input_ids": {0: batch, 1: tree}, "position_ids": {0: batch, 1: tree},
                "attention_mask": {0: batch, 2: tree, 3: mask_last}, "write_indices": {0: tree},
                "logits_index": {0: kept}, "past": [{0: batch, 2: cap}] * len(step.past_names())}
        if form == "concat":  # the mask spans P+T; trace with a consistent example
            p = ex[5][0].shape[2]
            t = ex[0].shape[1]
            ex = (*ex[:2], torch.zeros(ex[2].shape[0], 1, t, p + t), *ex[3:])
        with torch.no_grad():
            export_graph(step, ex, tmp / f"{form}.onnx", names, ["logits", "hidden_states", *step.present_names()],
                         axes)
        paths[form] = tmp / f"{form}.onnx"
    results: dict[str, dict[str, list[float]]] = {}
    P = args.past
    for _ in range(args.rounds):
        for T in (1, 16):
            C = 1 << int(np.ceil(np.log2(P + 64)))  # the capacity bucket the runtime would use
            for form, path in paths.items():
                kv = "concat" if form == "concat" else "inplace"
                out = subprocess.run([sys.executable, "-c", TIMER, str(path), kv, str(P), str(T), str(C),
                                      str(args.threads)], capture_output=True, text=True, check=True)
                results.setdefault(f"T={T}", {}).setdefault(form, []).append(json.loads(out.stdout)["ms"])
    summary = {k: {f: float(np.median(v)) for f, v in d.items()} for k, d in results.items()}
    report = {"past": P, "threads": args.threads, "rounds": args.rounds, "median_ms": summary}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
