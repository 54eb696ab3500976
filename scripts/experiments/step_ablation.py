"""A bundle's base step with parts cut out of its graph, timed against the whole one (timing only).

    python scripts/experiments/step_ablation.py BUNDLE [--past 100] [--rows 2] [--rounds 12] [--cut minima,zero-points]

Cuts (the numbers they compute are wrong; only their time means something):

- ``minima``: each ``q4_1`` linear's block-minimum term (the ``ReduceSum``/``Reshape`` and the
  ``Gemm`` or ``MatMul``/``Add`` that add it), leaving ``MatMulNBits`` alone;
- ``zero-points``: ``MatMulNBits`` without its zero-point input (the kernel's default of 8 instead of 0).

Every graph runs a ``--rows``-row step at ``--past`` positions with the cache bound in place, as the
runtime runs it, ten steps per round, rounds alternating their order; prints the median ms per step.
Used for docs/benchmarks.md. The cut graphs are written next to the bundle's and removed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def cut(model, what: str):
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = list(model.graph.node)
    made_by = {o: n for n in nodes for o in n.output}
    rename: dict[str, str] = {}
    drop: set[str] = set()
    changed = 0  # nodes edited in place (zero-points)
    for n in nodes:
        if what == "zero-points" and n.op_type == "MatMulNBits" and len(n.input) == 4 and n.input[3].endswith("zero_points"):
            del n.input[3]
            changed += 1
        if what != "minima":
            continue
        if n.op_type == "Gemm" and n.input[2] in made_by and made_by[n.input[2]].op_type == "MatMulNBits":
            sums, rename[n.output[0]] = made_by[n.input[0]], n.input[2]
            drop.add(n.name)
        elif n.op_type == "Add" and all(i in made_by for i in n.input) and \
                [made_by[i].op_type for i in n.input] == ["MatMulNBits", "MatMul"]:
            matmul, rename[n.output[0]] = made_by[n.input[1]], n.input[0]
            sums = made_by[matmul.input[0]]
            drop.update((n.name, matmul.name))
        else:
            continue
        drop.update((sums.name, made_by[sums.input[0]].name))  # the ReduceSum and its Reshape
    kept = [n for n in nodes if n.name not in drop]
    for n in kept:
        n.input[:] = [rename.get(i, i) for i in n.input]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model, len(drop) + changed


def main() -> None:
    import onnx
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--past", type=int, default=100)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--cut", default="minima,zero-points")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    bundle = Path(args.bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    base = next(g for g in manifest["graphs"] if g["target"] == "ort" and g["role"] == "base")
    src = bundle / base["file"]
    whole = onnx.load(str(src), load_external_data=False)
    paths = {"whole": src}
    for what in args.cut.split(","):
        model, dropped = cut(whole, what)
        paths[what] = bundle / f"_cut_{what}.onnx"  # beside the graph: its external data resolves
        onnx.save(model, str(paths[what]))
        print(f"{what}: {dropped} nodes cut or changed")
    try:
        cfg = manifest["model"]
        layers, kv_heads, head_dim = cfg["num_layers"], cfg["num_kv_heads"], cfg["head_dim"]
        cap, t, past = 1 << (args.past + args.rows).bit_length(), args.rows, args.past
        rng = np.random.default_rng(0)
        cache = [rng.standard_normal((1, kv_heads, cap, head_dim)).astype(np.float32) * 0.1
                 for _ in range(2 * layers)]
        runs = {}
        for name, path in paths.items():
            so = ort.SessionOptions()
            so.intra_op_num_threads = args.threads
            so.log_severity_level = 3
            sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            b = sess.io_binding()
            outs = [o.name for o in sess.get_outputs()]
            for p, buf in zip([i.name for i in sess.get_inputs() if i.name.startswith("past")], cache):
                ov = ort.OrtValue.ortvalue_from_numpy(buf)
                b.bind_ortvalue_input(p, ov)
                b.bind_ortvalue_output(p.replace("past", "present"), ov)
            mask = np.zeros((1, 1, t, cap), np.float32)
            mask[..., past + t:] = np.finfo(np.float32).min
            b.bind_cpu_input("input_ids", rng.integers(100, cfg["vocab_size"], (1, t)).astype(np.int64))
            b.bind_cpu_input("position_ids", np.arange(past, past + t, dtype=np.int64)[None])
            b.bind_cpu_input("attention_mask", mask)
            b.bind_cpu_input("write_indices", np.arange(past, past + t, dtype=np.int64))
            b.bind_cpu_input("logits_index", np.arange(t, dtype=np.int64))
            for o in outs:
                if not o.startswith("present"):
                    b.bind_output(o)
            runs[name] = (sess, b, [])
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                sess, b, ms = runs[name]
                sess.run_with_iobinding(b)
                t0 = time.perf_counter()
                for _ in range(10):
                    sess.run_with_iobinding(b)
                ms.append((time.perf_counter() - t0) * 100)
        for name, (_, _, ms) in runs.items():
            print(f"{name:12s} {np.median(ms):6.2f} ms per {t}-row step at past {past} (min {min(ms):.2f})")
    finally:
        for name, path in paths.items():
            if name != "whole":
                path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
