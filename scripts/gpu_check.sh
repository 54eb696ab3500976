#!/usr/bin/env bash
# The GPU check: prepared, offline runs on a lent GPU. Each exits 0 only if every stage it ran passed.
#
#   bash scripts/gpu_check.sh                    # random weights of the real shape (about 3 minutes on an H200)
#   bash scripts/gpu_check.sh --real             # the real SmolLM2 from the GGUF sent in parts (exporter/bench/gpu_real.py)
#   bash scripts/gpu_check.sh --train            # drafts trained on the device from that GGUF (exporter/train/ondevice.py)
#   bash scripts/gpu_check.sh --dry-run [--real] [--train]  # the same stages on CPU torch (random: a tiny shape;
#                                                # real and train: the embedded GGUF, fp32, a few prompts); CI runs them
#
# Results in $OUT (default ./gpu_check_out). A device session of 15 minutes: call 1 runs the random-weight check
# (limits below: at most 9.5 minutes) and carries the GGUF's first part with prompts.json (`gpu_transfer stash`);
# call 2 carries the second part; call 3 carries the last part with train-prompts.npz (`python -m
# specdeploy.exporter.train.ondevice prepare`) and runs `--real --train` (at most 9.8 minutes), which joins them.
#
# The device has no network and receives at most 64 MiB per call, this repository's tracked tree included:
# - the base runs with random weights of the real SmolLM2-135M shape, generated on the device (step times
#   depend on shapes, not values; exporter/bench/gpu.py); each draft's speed-up is predicted from tau
#   measured on the CPU with the real weights (docs/results/mtbench32_fp32_drafts_amd_avx2.json);
# - a larger file (the GGUF) can follow in parts over consecutive calls (exporter/bench/gpu_transfer.py):
#   each call carries one part and runs `gpu_transfer stash`; with SPECDEPLOY_GPU_STORE set to the folder
#   the parts were stashed in, the weights stage reassembles the file and checks its sha256; the dry run
#   sends a generated file in parts through the same commands;
# - nothing is installed: specdeploy is imported from this checkout through a folder of links, and the
#   tests stage uses the image's pytest and click (a missing one fails that stage, saying so).
# Files in $OUT (at most 6, under the 7 that may come back): gpu_check.json (stages with their reasons,
# environment, bench, tests, real, train), bench.json (rewritten after every bench stage), stages.log (every
# stage's output), tests.xml; with --real or --train instead of bench.json and tests.xml: real.json, and
# train.json with chimera.safetensors and cerberus.safetensors (under 16 MiB each). Stages and limits: env 60 s,
# setup 30 s, weights 90 s, then bench 300 s and tests 60 s, or the real stage 220 s and the train stage 160 s
# (dry runs: 400 s each); summary 30 s.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT="$PWD"
DRY=0
REAL=0
TRAIN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --real) REAL=1 ;;
    --train) TRAIN=1 ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run] [--real] [--train]" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ] && [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/specdeploy_gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
export SPECDEPLOY_THREADS="${SPECDEPLOY_THREADS:-8}"
START=$(date +%s)
: >"$OUT/stages.log"
: >"$WORK/stages.txt"

stage() {  # stage NAME LIMIT_S COMMAND...: run it under a time limit, log it, record rc and seconds
  local name="$1" limit="$2" t0 rc
  shift 2
  t0=$(date +%s)
  echo "[gpu-check] $name (limit ${limit}s) ..." >&2
  echo "=== $name (limit ${limit}s)" >>"$OUT/stages.log"
  timeout "$limit" "$@" >>"$OUT/stages.log" 2>&1
  rc=$?
  echo "$name:$rc:$(( $(date +%s) - t0 ))" >>"$WORK/stages.txt"
  echo "[gpu-check] $name: rc $rc" >&2
}

# --- env: what the machine has, read once (the summary imports nothing heavy) --------------------------
env_json() {
  "$PY" - "$WORK/env.json" <<'PYEOF'
import json, platform, subprocess, sys
env = {"python": platform.python_version(), "machine": platform.machine()}
for mod in ("torch", "numpy", "onnxruntime", "tensorrt", "pytest", "click"):
    try:
        env[mod] = __import__(mod).__version__
    except ImportError:
        env[mod] = None
if env["torch"]:
    import torch
    env["cuda"] = torch.version.cuda
    env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
try:
    env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                                        "--format=csv,noheader"], capture_output=True, text=True,
                                       timeout=10).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    env["nvidia_smi"] = None
open(sys.argv[1], "w").write(json.dumps(env))
print(env)
PYEOF
}
export -f env_json
export ROOT WORK PY DRY
stage env 60 bash -c env_json

# --- setup: specdeploy importable from this checkout, offline ------------------------------------------
setup() {
  mkdir -p "$WORK/site/specdeploy"
  for pkg in exporter runtime graphs; do ln -s "$ROOT/$pkg" "$WORK/site/specdeploy/$pkg"; done
  PYTHONPATH="$WORK/site" "$PY" -c "import specdeploy.exporter.bench.gpu; print('specdeploy importable')"
}
export -f setup
stage setup 30 bash -c setup
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

# --- weights: the parts sent over earlier calls, reassembled and checked --------------------------------
weights() {
  local t="$PY -m specdeploy.exporter.bench.gpu_transfer"
  if [ "$DRY" = 1 ]; then  # a generated 3 MiB file in 1 MiB parts, carried by two "calls"
    head -c $((3 << 20)) /dev/urandom >"$WORK/model.bin"
    $t split "$WORK/model.bin" "$WORK/parts" --part-mib 1 || return 1
    mkdir -p "$WORK/call1" "$WORK/call2"
    mv "$WORK/parts/parts.json" "$WORK/parts/part-000" "$WORK/call1/" && mv "$WORK/parts/"part-* "$WORK/call2/"
    $t stash "$WORK/call1" "$WORK/store" && $t stash "$WORK/call2" "$WORK/store" || return 1
    $t join "$WORK/store" "$WORK/joined.bin" && cmp "$WORK/model.bin" "$WORK/joined.bin" && echo "identical"
  elif [ -n "${SPECDEPLOY_GPU_STORE:-}" ]; then
    $t join "$SPECDEPLOY_GPU_STORE" "$WORK/model.gguf"
  else
    echo "no parts sent (SPECDEPLOY_GPU_STORE unset): random weights only"
  fi
}
export -f weights
stage weights 90 bash -c weights

if [ "$REAL" = 1 ]; then
  # --- real: the GGUF the weights stage joined (a dry run: the embedded one), on the device -------------
  real() {
    local gguf="$WORK/model.gguf" args=()
    if [ "$DRY" = 1 ]; then
      gguf="$("$PY" -c 'from specdeploy.exporter.source import default_gguf_path; print(default_gguf_path())')" || return 1
      args+=(--dry-run --max-new-tokens 16 --num-prompts 2)
    fi
    [ -n "${SPECDEPLOY_GPU_STORE:-}" ] && args+=(--prompts "$SPECDEPLOY_GPU_STORE/prompts.json")
    "$PY" -m specdeploy.exporter.bench.gpu_real run "$OUT/real.json" --gguf "$gguf" "${args[@]}"
  }
  export -f real
  stage real "$([ "$DRY" = 1 ] && echo 400 || echo 220)" bash -c real  # the dry run: 135M in torch on 2 cores
fi
if [ "$TRAIN" = 1 ]; then
  # --- train: self-distilled data and the two drafts, from the joined GGUF (a dry run: the embedded one) -------
  train() {
    local gguf="$WORK/model.gguf" prompts="${SPECDEPLOY_GPU_STORE:-$WORK}/train-prompts.npz" args=()
    if [ "$DRY" = 1 ]; then  # the prompts made here, as `prepare` makes them before the call
      gguf="$("$PY" -c 'from specdeploy.exporter.source import default_gguf_path; print(default_gguf_path())')" || return 1
      prompts="$WORK/train-prompts.npz"
      "$PY" -m specdeploy.exporter.train.ondevice prepare "$prompts" --max-seqs 48 --reply-tokens 40 || return 1
      args+=(--dry-run)
    fi
    "$PY" -m specdeploy.exporter.train.ondevice run "$OUT" --gguf "$gguf" --prompts "$prompts" "${args[@]}"
  }
  export -f train
  stage train "$([ "$DRY" = 1 ] && echo 400 || echo 160)" bash -c train
fi
if [ "$REAL" = 0 ] && [ "$TRAIN" = 0 ]; then
  # --- bench: before the tests, so that a slow test costs no figure -------------------------------------
  BENCH_ARGS=(--cpu-results docs/results/mtbench32_fp32_drafts_amd_avx2.json)
  if [ "$DRY" = 1 ]; then BENCH_ARGS+=(--dry-run --max-new-tokens 16 --num-prompts 2); fi
  stage bench 300 "$PY" -m specdeploy.exporter.bench.gpu "$OUT/bench.json" "${BENCH_ARGS[@]}"

  # --- tests: every test marked gpu (on a GPU, a run in which every test skipped is a failure) ------------
  stage tests 60 "$PY" -m pytest -m gpu tests/integration/test_gpu_path.py tests/integration/test_gpu_check.py -q -rA \
    -p no:cacheprovider --junitxml="$OUT/tests.xml"
fi

# --- summary: once, stdlib only, under a limit; its verdict is the exit code ----------------------------
timeout 30 "$PY" - "$OUT" "$WORK" "$START" "$DRY" "$REAL" "$TRAIN" <<'PYEOF'
import json, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, work, start, dry = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
real, train = sys.argv[5] == "1", sys.argv[6] == "1"
docs = (("real",) if real else ()) + (("train",) if train else ()) or ("bench",)
stages, failures = {}, []
for line in (work / "stages.txt").read_text().split():
    name, rc, secs = line.split(":")
    stages[name] = {"rc": int(rc), "seconds": int(secs)}
    if int(rc):
        why = "timed out" if int(rc) in (124, 137) else f"exit code {rc}"
        failures.append(f"stage {name}: {why} (stages.log)")
summary = {"schema": 2, "dry_run": dry, "real": real, "train": train, "stages": stages,
           "wall_s": int(time.time()) - start}
try:
    summary["env"] = json.loads((work / "env.json").read_text())
except (OSError, ValueError):
    summary["env"] = None
for what in docs:
    if (out / f"{what}.json").is_file():
        doc = summary[what] = json.loads((out / f"{what}.json").read_text())
        failures += [f"{what} {name}: {doc['errors'].get(name, st['status'])[-300:]}"
                     for name, st in doc["stages"].items() if st["status"] != "ok"]
    else:
        failures.append(f"{what}: no {what}.json")
xml = out / "tests.xml"
if "bench" in docs and xml.is_file():  # --real and --train run no tests stage
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    t = summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    t["cases"] = {c.get("name"): ("failed" if c.find("failure") is not None or c.find("error") is not None
                                  else "skipped" if c.find("skipped") is not None else "passed")
                  for c in suite.iter("testcase")}
    if t["failures"] or t["errors"]:
        failures.append(f"tests: {t['failures']} failed, {t['errors']} errors")
    if t["tests"] == t["skipped"]:
        if dry:
            t["note"] = "every test skipped: a dry run has no CUDA"
        else:
            failures.append(f"tests: all {t['tests']} skipped")
elif "bench" in docs:
    failures.append("tests: no tests.xml")
summary["passed"], summary["failures"] = not failures, failures
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
for f in failures:
    print(f"[gpu-check] FAILED {f}", file=sys.stderr)
sys.exit(1 if failures else 0)
PYEOF
rc=$?
[ "$rc" = 124 ] && echo "[gpu-check] the summary timed out" >&2
echo "wrote $OUT/gpu_check.json ($(( $(date +%s) - START )) s): $([ "$rc" = 0 ] && echo passed || echo FAILED)" >&2
exit "$rc"
