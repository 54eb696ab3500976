#!/usr/bin/env bash
# The GPU check: one prepared, offline run on a lent GPU that returns figures within ~8 minutes.
#
#   bash scripts/gpu_check.sh             # on the GPU machine; results in $OUT (default ./gpu_check_out)
#   bash scripts/gpu_check.sh --dry-run   # the same stages on CPU torch with a tiny shape (CI runs this)
#
# The device has no network and receives at most 64 MiB per call (this repository included), so:
# - no model travels: the bench times the real SmolLM2-135M architecture with random weights generated
#   on the device (step times depend on shapes, not values), and predicts each draft's end-to-end speed
#   from tau measured on the CPU with the real weights (docs/results/s10_32_fp32.json) over the device's
#   step and draft costs (the shipped Chimera runs in torch on the device); see exporter/bench/gpu.py;
# - nothing is installed from an index: specdeploy is imported from this checkout through a folder of
#   links (no pip, no build backend), and the tests' extra packages come from the wheels in ./.whl/ when
#   they are missing there (carry ".whl"; the list and sizes are in scripts/gpu_wheels.txt);
# - JSON is written before anything slow and after every stage: $OUT/gpu_check.json (summary: stages,
#   environment, bench, tests), $OUT/bench.json, and the logs.
# Stages and limits (7 minutes at the very most): env (<= 30 s), setup (<= 45 s), bench (<= 270 s),
# tests (<= 90 s).
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT="$PWD"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ] && [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/specdeploy_gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export SPECDEPLOY_THREADS="${SPECDEPLOY_THREADS:-8}"
START=$(date +%s)
: >"$OUT/stages.txt"

summary() {  # gpu_check.json from what the stages left (stdlib only: it must work when nothing else does)
  "$PY" - "$OUT" "$START" "$DRY" <<'PYEOF'
import json, platform, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, start, dry = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
stages = {}
for line in (out / "stages.txt").read_text().split():
    name, rc, secs = line.split(":")
    stages[name] = {"rc": int(rc), "seconds": int(secs)}
summary = {"schema": 1, "dry_run": dry, "stages": stages, "wall_s": int(time.time()) - start,
           "env": {"python": platform.python_version(), "machine": platform.machine()}}
for mod in ("torch", "onnxruntime", "tensorrt", "pytest"):
    try:
        summary["env"][mod] = __import__(mod).__version__
    except ImportError:
        summary["env"][mod] = None
try:
    import torch
    summary["env"]["cuda"] = torch.version.cuda
    summary["env"]["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except ImportError:
    pass
try:
    summary["env"]["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=10).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    summary["env"]["nvidia_smi"] = None
if (out / "bench.json").is_file():
    summary["bench"] = json.loads((out / "bench.json").read_text())
xml = out / "tests.xml"
if xml.is_file():
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["tests"]["cases"] = {
        c.get("name"): ("failed" if c.find("failure") is not None or c.find("error") is not None
                        else "skipped" if c.find("skipped") is not None else "passed")
        for c in suite.iter("testcase")}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
PYEOF
}
stage() {  # stage NAME LIMIT_S COMMAND...: run it under a time limit, log it, record rc and seconds, summarise
  local name="$1" limit="$2" t0 rc
  shift 2
  t0=$(date +%s)
  echo "[gpu-check] $name ..." >&2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name:$rc:$(( $(date +%s) - t0 ))" >>"$OUT/stages.txt"
  echo "[gpu-check] $name: rc $rc" >&2
  summary
}

# --- env: the summary exists before anything slow ---------------------------------------------------
stage env 30 "$PY" -c "import sys; print(sys.version)"

# --- setup: specdeploy importable from this checkout, offline --------------------------------------
setup() {
  mkdir -p "$WORK/site/specdeploy"
  for pkg in exporter runtime graphs; do ln -s "$ROOT/$pkg" "$WORK/site/specdeploy/$pkg"; done
  "$PY" -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || return 1
  local missing=()
  for pair in pytest:pytest click:click; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if [ -d .whl ]; then
      "$PY" -m pip install -q --no-index --no-deps --find-links .whl -r scripts/gpu_wheels.txt \
        || echo "could not install the tests' wheels from .whl/; the tests stage may not run"
    else
      echo "missing ${missing[*]} and no .whl/ folder: the tests stage will not run (the bench needs neither)"
    fi
  fi
  PYTHONPATH="$WORK/site" "$PY" -c "import specdeploy.exporter.bench.gpu; print('specdeploy importable')"
}
export -f setup
export ROOT WORK PY
stage setup 45 bash -c setup
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

# --- bench: before the tests, so that a slow test costs no figure -----------------------------------
BENCH_ARGS=(--cpu-results docs/results/s10_32_fp32.json)
if [ "$DRY" = 1 ]; then BENCH_ARGS+=(--dry-run --max-new-tokens 16 --num-prompts 2); fi
stage bench 270 "$PY" -m specdeploy.exporter.bench.gpu "$OUT/bench.json" "${BENCH_ARGS[@]}"

# --- tests: every test marked gpu (skipped without CUDA) ------------------------------------------------
if "$PY" -c "import pytest" 2>/dev/null; then
  stage tests 90 "$PY" -m pytest -m gpu tests/test_gpu_path.py tests/test_gpu_check.py -q -rA -p no:cacheprovider \
    --junitxml="$OUT/tests.xml"
else
  echo "tests:127:0" >>"$OUT/stages.txt"
  summary
fi
echo "wrote $OUT/gpu_check.json ($(( $(date +%s) - START )) s)" >&2
