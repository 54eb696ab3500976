"""One ``specdeploy bench`` variant in its own process, driven by JSON lines on stdin/stdout.

Each variant gets its own process because torch and ONNX Runtime both start thread pools that
fight for the cores when they live in one process; timing either one there is meaningless.

Protocol (one JSON object per line):
    worker -> {"event": "ready", "pid": ...}               after loading
           -> {"event": "error", "message": ...}           a user error (SpecDeployError); exits 2
    parent -> {"op": "generate", "ids": [...], "max_new_tokens": M[, "structured": {"messages": [...],
               "constraint": {response_format | tools, tool_choice}}]}   a constrained prompt (ids render messages)
    worker -> {"event": "result", ...RunResult fields}
    parent -> {"op": "score", "ids": [...]}              teacher-forced quality inputs on one text
    worker -> {"event": "score", "argmax": [...], "nll": [...]}  (both null: this runner has no logits)
    parent -> {"op": "quit"} or EOF                        the worker exits 0
Any other failure prints its traceback on stderr and exits 1; the parent reports the stderr tail.

    python -m specdeploy.exporter.bench.worker --variant ar --bundle bundles/smollm2 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TextIO

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "SPECDEPLOY_THREADS")


def _protocol_channel() -> TextIO:
    """Keep the real stdout for the protocol and point fd 1 at stderr, so stray prints from any
    library (Python or C) cannot corrupt the JSON stream."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def _send(channel: TextIO, message: dict) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdeploy.exporter.bench.worker")
    parser.add_argument("--variant", required=True)
    parser.add_argument("--bundle", required=True, type=Path)
    parser.add_argument("--threads", required=True, type=int)
    parser.add_argument("--tree", default=None)
    args = parser.parse_args(argv)
    for var in THREAD_ENV:  # the parent sets them too; this covers a worker started by hand
        os.environ[var] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    channel = _protocol_channel()

    from specdeploy.exporter.bench.registry import RUNNERS, VARIANTS
    from specdeploy.exporter.bench.spec import StructuredPrompt
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.errors import SpecDeployError

    spec = VARIANTS[args.variant]
    try:
        manifest = read_manifest(args.bundle)
        runner = RUNNERS[spec.runner](args.bundle, manifest, spec, args.threads, args.tree)
    except SpecDeployError as exc:
        _send(channel, {"event": "error", "message": str(exc)})
        return 2
    _send(channel, {"event": "ready", "pid": os.getpid()})
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "quit":
                break
            if request["op"] not in ("generate", "score"):
                raise ValueError(f"unknown bench worker op {request['op']!r}")
            ids = [int(i) for i in request["ids"]]
            try:
                if request["op"] == "score":
                    score = runner.score(ids)
                    _send(channel, {"event": "score", "argmax": score.argmax if score else None,
                                    "nll": score.nll if score else None})
                    continue
                structured = request.get("structured")
                result = runner.generate(ids, int(request["max_new_tokens"]),
                                         StructuredPrompt.from_json(structured) if structured else None)
            except SpecDeployError as exc:
                _send(channel, {"event": "error", "message": str(exc)})
                return 2
            _send(channel, {"event": "result", **dataclasses.asdict(result)})
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
