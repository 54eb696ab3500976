"""onnxruntime-genai on structured prompt sets: it decodes under its own guidance with the schema llama.cpp's grammar
gets, or, where the installed genai has none, the bench skips it there. The real-model test needs the peers extra
(``pip install 'specdeploy[peers]'``), which scripts/test.sh does not install: it skips without onnxruntime-genai."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
from specdeploy.exporter.bench import promptsets as ps
from specdeploy.exporter.bench.peers import OrtGenaiRunner, constraint_schema
from specdeploy.exporter.bench.registry import VARIANTS
from specdeploy.exporter.bench.spec import StructuredPrompt
from specdeploy.exporter.bench.structured import (
    Constraint,
    check_answer,
    json_schema_format,
    tool_call_schema,
)

# A value the model never writes unasked: an answer that holds it was decoded under the schema.
ODD_SCHEMA = {"type": "object", "properties": {"code": {"const": "zq-7731"}}, "required": ["code"],
              "additionalProperties": False}


def test_the_schema_is_llama_cpps():
    """The response format's schema; json_object as any object; tools as one call of one of them, as JSON."""
    fmt = json_schema_format("odd", ODD_SCHEMA)
    assert constraint_schema(Constraint(fmt)) == ODD_SCHEMA
    assert constraint_schema(Constraint({"type": "json_object"})) == {"type": "object"}
    tools = ps.load_set("tool-calls", 1)[0].tools
    assert constraint_schema(Constraint(tools=tools, tool_choice="required")) == tool_call_schema(tools)


@pytest.mark.parametrize("has_guidance", [True, False])
def test_structured_sets_run_genai_only_where_it_has_guidance(monkeypatch, has_guidance):
    """``constrains`` is what the bench reads to skip a runner on structured sets (the hf variant's skip in
    test_structured_sets.py shows the note): it follows the installed genai's ``GeneratorParams.set_guidance``."""
    fake = types.ModuleType("onnxruntime_genai")
    fake.GeneratorParams = type("GeneratorParams", (), {"set_guidance": lambda self, kind, data: None}
                                if has_guidance else {})
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", fake)
    assert OrtGenaiRunner.constrains is has_guidance
    assert "guidance" in VARIANTS["ort-genai-int4"].description


@pytest.fixture(scope="module")
def genai_smollm2(tiny_bundle):
    """onnxruntime-genai's int4 build of the embedded SmolLM2 GGUF, as the bench's ort-genai-int4 runs it, with its
    tokenizer (the tiny bundle's manifest, its source and EOS made SmolLM2's)."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install "
                                                    "'specdeploy[peers]')")
    from specdeploy.exporter.source import cached_hf_folder, default_gguf_path
    from specdeploy.runtime.bundle import SourceInfo, read_manifest
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(cached_hf_folder(str(gguf)), local_files_only=True)
    manifest = read_manifest(tiny_bundle)
    manifest = manifest.replace(source=SourceInfo(str(gguf), "gguf", "0" * 64),
                                model=dataclasses.replace(manifest.model, eos_token_ids=(tokenizer.eos_token_id,)))
    runner = OrtGenaiRunner(tiny_bundle, manifest, VARIANTS["ort-genai-int4"], 2, None)
    yield runner, tokenizer
    runner.close()


def _answer(genai_smollm2, text: str, constraint: Constraint, max_new_tokens: int = 96) -> tuple[str, str]:
    runner, tokenizer = genai_smollm2
    messages = ({"role": "user", "content": text},)
    ids = list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    r = runner.generate(ids, max_new_tokens, StructuredPrompt(messages, constraint))
    return tokenizer.decode(r.tokens, skip_special_tokens=True), r.finish_reason


def test_genai_decodes_under_the_schema_on_the_real_model(genai_smollm2):
    """A value the model would not write unasked comes out exactly, written compactly (guidance is on, not silently
    dropped as in a genai built without it), and a json-template prompt's answer meets its schema, ending by itself."""
    text, finish = _answer(genai_smollm2, "Reply with a JSON object.", Constraint(json_schema_format("odd", ODD_SCHEMA)),
                           32)
    assert text == '{"code":"zq-7731"}' and finish == "stop", text  # compact JSON, as our runtime writes it
    item = ps.load_set("json-template", 1)[0]
    text, finish = _answer(genai_smollm2, item.text, item.constraint)
    assert check_answer(item.constraint, text) is None and finish == "stop", (text, check_answer(item.constraint, text))

