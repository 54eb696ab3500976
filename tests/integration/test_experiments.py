"""scripts/experiments: each remaining script still starts against today's package and explains itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "scripts" / "experiments"
WITH_HELP = ("server_vs_inprocess", "openai_clients", "graph_ab", "step_ablation", "replay_drafts")


def test_every_experiment_script_is_covered_here_and_listed_in_its_readme():
    scripts = sorted(p.stem for p in EXPERIMENTS.glob("*.py"))
    assert scripts == sorted((*WITH_HELP, "gpu_padded_probe"))  # the probe's --dry-run: test_gpu_check.py
    readme = (EXPERIMENTS / "README.md").read_text()
    assert all(f"`{name}.py`" in readme for name in scripts)


@pytest.mark.parametrize("name", WITH_HELP)
def test_experiment_help(name):
    run = subprocess.run([sys.executable, str(EXPERIMENTS / f"{name}.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage:") and f"{name}.py" in run.stdout
