"""A ``q4_1`` bundle's 4-bit ``MatMulNBits`` rewritten as 8-bit ``MatMulNBits`` of the same values.

    python scripts/experiments/q4_1_as_8bit.py bundles/smollm2-q4_1 bundles/q4_1-8bit

The Q4_1 graph multiplies ``d * q`` (``q`` in 0..15, zero point 0) with ``MatMulNBits`` at 4 bits and
adds the block minima after. Stored at 8 bits (one byte per ``q``, the same scales, zero point 0) the
weights are the same numbers, but ONNX Runtime runs its 8-bit kernels, which were row-exact on an
emulated AVX2 CPU where the 4-bit ones are not (docs/benchmarks.md, session 21): such a bundle may take
the ``one-graph`` step plan there instead of ``two-rows``. The new bundle keeps the base graph, the
tokenizer and the n-gram table (drafts are dropped: they share the old base's data file); its
manifest carries the new graph's hash, so the runtime probes it afresh. Compare the two with
``graph_ab.py`` or ``specdeploy bench``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from specdeploy.runtime.bundle import MANIFEST_NAME, hash_files


def _attr(node, name: str):
    return next(a for a in node.attribute if a.name == name)


def to_8bit(model: onnx.ModelProto) -> int:
    """Rewrite every 4-bit ``MatMulNBits`` whose zero points are 0 in place; returns how many."""
    inits = {t.name: t for t in model.graph.initializer}
    done = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or _attr(node, "bits").i != 4:
            continue
        packed = numpy_helper.to_array(inits[node.input[1]])  # [N, blocks, block/2]: 2i low nibble, 2i+1 high
        n, blocks, half = packed.shape
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, 2 * half).astype(np.uint8)
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(q, node.input[1]))
        if len(node.input) > 3 and node.input[3]:
            if numpy_helper.to_array(inits[node.input[3]]).any():
                raise SystemExit(f"{node.name}: zero points other than 0; not a q4_1 graph")
            inits[node.input[3]].CopyFrom(numpy_helper.from_array(np.zeros(n * blocks, np.uint8), node.input[3]))
        _attr(node, "bits").i = 8
        done += 1
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("out")
    args = ap.parse_args()
    src, dst = Path(args.bundle), Path(args.out)
    manifest = json.loads((src / MANIFEST_NAME).read_text())
    (base,) = [g for g in manifest["graphs"] if g["role"] == "base"]
    dst.mkdir(parents=True)
    model = onnx.load(str(src / base["file"]), load_external_data=True)
    print(f"rewrote {to_8bit(model)} MatMulNBits from 4 to 8 bits")
    data = f"{base['file']}.data"
    onnx.save(model, str(dst / base["file"]), save_as_external_data=True, location=data, size_threshold=1024)
    base.update(data_files=[data], sha=hash_files([dst / base["file"], dst / data]))
    manifest["drafts"] = [d for d in manifest["drafts"] if not d.get("graphs")]  # keep the n-gram table
    for f in [manifest["tokenizer"]["file"], *(f.name for f in src.glob("*.npz")), "README.txt"]:
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
