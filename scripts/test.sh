#!/usr/bin/env bash
# One command from a fresh clone: set up .venv (idempotent) and run the whole test suite, including
# the tests on the real SmolLM2 model. Extra arguments go to pytest (e.g. -m "not slow"). The long sweeps (tests
# marked sweep) skip unless asked for: SPECDEPLOY_SWEEPS=1 bash scripts/test.sh, or bash scripts/test.sh -m sweep.
export SPECDEPLOY_EXTRAS="${SPECDEPLOY_EXTRAS:-dev,serve,ray}"  # the tests also cover `serve --ray`
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export SPECDEPLOY_THREADS="${SPECDEPLOY_THREADS:-2}"
# tests/integration/test_emulated_cpu.py runs bundles under QEMU's AVX2-only EPYC (the CPU kind this machine may not
# be), as a sweep. Where sweeps run, install qemu-user where the machine allows (root and apt); elsewhere those tests
# skip and say why.
SWEEPS="${SPECDEPLOY_SWEEPS:-0}"
case " $* " in *sweep*) SWEEPS=1 ;; esac
if [ "$SWEEPS" = 1 ] && ! command -v qemu-x86_64 >/dev/null && [ "$(uname -m)" = x86_64 ] && [ "$(id -u)" = 0 ] \
   && command -v apt-get >/dev/null; then
  echo "[setup] installing qemu-user (apt) for the emulated-CPU tests" >&2
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user >/dev/null 2>&1; }; } \
    || echo "[setup] qemu-user could not be installed: the emulated-CPU tests will skip" >&2
fi
python -m pytest -q --durations=15 "$@"  # the slowest tests listed: CI must stay well inside its limit
