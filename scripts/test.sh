#!/usr/bin/env bash
# One command from a fresh clone: set up .venv (idempotent) and run the whole test suite, including
# the tests on the real SmolLM2 model. Extra arguments go to pytest (e.g. -m "not slow").
export SPECDEPLOY_EXTRAS="${SPECDEPLOY_EXTRAS:-dev,serve,ray}"  # the tests also cover `serve --ray`
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export SPECDEPLOY_THREADS="${SPECDEPLOY_THREADS:-2}"
python -m pytest -q "$@"
