"""The ``gguf`` precision on a synthetic GGUF that holds every block format (``gguf_synth.py``), as a Qwen2
and a Llama file (llama.cpp writes Mistral models as "llama" too): nothing outside ``runtime/architectures.py``
names the family.

The real Qwen2.5-Coder-0.5B (Q5_0, Q8_0, Q4_K, Q6_K) runs the same path in ``test_qwen.py`` where its extra is
installed; this file runs in CI.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf_synth import FORMATS, write_tiny_gguf


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def gguf_bundle(request, tmp_path_factory, smol_tokenizer_dir):
    from specdeploy.exporter.export.base import export_base
    from specdeploy.exporter.source import default_gguf_path

    folder = tmp_path_factory.mktemp(f"gguf_{request.param}")
    source = write_tiny_gguf(folder / f"tiny-{request.param}.gguf", default_gguf_path(), arch=request.param)
    out = folder / "bundle"
    export_base(str(source), out, precision="gguf", max_context=512, max_tree=64, progress=lambda m: None)
    return request.param, source, out


def test_every_block_format_is_kept_and_the_manifest_says_how(gguf_bundle):
    """Each decoder linear keeps its own format, the F16 one is re-quantized to 8 bits, the embedding keeps
    its Q5_0 blocks (no fp32 table in the graph) and Qwen's untied output its Q6_K blocks."""
    import onnx
    from specdeploy.exporter.export.gguf_blocks import REQUANTIZED
    from specdeploy.runtime.bundle import read_manifest

    arch, _, bundle = gguf_bundle
    entry = read_manifest(bundle).graph("base", "ort")
    assert entry.precision == "gguf"
    held = dict(entry.weight_blocks)
    for tensor, kind in FORMATS.items():
        if tensor == "output" and arch != "qwen2":  # llama: tied, the lm_head multiplies the embedding's blocks
            assert "output.weight" not in held
            continue
        assert held[f"{tensor}.weight"] == (REQUANTIZED if kind == "F16" else kind), tensor
    graph = onnx.load(str(bundle / entry.file), load_external_data=False).graph
    float_tables = [t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and 49152 in t.dims]
    assert float_tables == []  # neither the embedding nor the lm_head is an fp32 table
    ops = {n.op_type for n in graph.node}
    assert {"MatMulNBits", "BitShift", "Gemm"} <= ops and "MatMul" not in ops


def test_the_block_graph_matches_torch_and_speculation_equals_plain(gguf_bundle):
    """The bundle against the dequantized model in torch (validate's cases, int8 activations' bounds), and
    prompt lookup identical to plain greedy on it."""
    from specdeploy.exporter.check.validate import compare_base
    from specdeploy.exporter.source import load_model
    from specdeploy.graphs.base_step import BaseStep
    from specdeploy.runtime import load
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.decode import GenerationConfig

    _, source, bundle = gguf_bundle
    loaded = load_model(str(source))
    step = BaseStep(loaded.model).eval()
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog. Speculative decoding")["input_ids"][:16]
    checks = compare_base(bundle, read_manifest(bundle), step, list(ids), progress=lambda m: None)
    assert checks and all(c.passed for c in checks), [c for c in checks if not c.passed]
    prefill = [c for c in checks if c.case.startswith("prefill") and c.output == "logits"]
    assert prefill[0].argmax_rate >= 0.8  # the same weights: int8 activations flip only near ties
    with load(bundle, draft=None) as plain, load(bundle, draft="prompt-lookup") as spec:
        prompt = plain.encode("one two three four one two three four one two three four one two", chat=False)
        want = plain.generate_ids(prompt, GenerationConfig(32))
        assert spec.generate_ids(prompt, GenerationConfig(32)) == want


def test_the_gguf_precision_needs_a_gguf(tiny_model_factory, tmp_path):
    from specdeploy.exporter.export.base import export_base
    from specdeploy.exporter.export.quantize import PrecisionError

    with pytest.raises(PrecisionError, match="keeps a GGUF's own blocks.*--precision int4"):
        export_base(str(tiny_model_factory("qwen2")), tmp_path / "b", precision="gguf", progress=lambda m: None)
    assert not (tmp_path / "b").exists()


def test_llama_cpps_rotary_row_order_is_undone_per_head():
    """q_proj/k_proj rows as llama.cpp's converter writes them (each head's halves interleaved), put back."""
    from specdeploy.exporter.export.gguf_blocks import gguf_row_order

    heads, dim = 3, 8
    hf = np.arange(heads * dim)  # row ids in transformers' order
    gguf = hf.reshape(heads, 2, dim // 2).swapaxes(1, 2).reshape(-1)  # the converter's permutation
    assert gguf_row_order(heads * dim, heads).tolist() == np.argsort(gguf).tolist()
    assert gguf[gguf_row_order(heads * dim, heads)].tolist() == hf.tolist()


def test_quantized_outputs_pass_on_relative_error_and_a_broken_graph_still_fails():
    """A larger model's activations exceed the absolute bound at a small relative error (Qwen 1.5B: 12.3 at
    0.053); a graph off by its own size fails, and a differing argmax fails whatever the error."""
    from specdeploy.exporter.check.validate import QUANTIZED_REL_L2, OutputCheck

    assert OutputCheck("prefill[ort]", "hidden_states", 12.3, 12.0, None, None, 0.053).passed
    assert not OutputCheck("prefill[ort]", "hidden_states", 12.3, 12.0, None, None, 1.0).passed
    assert not OutputCheck("prefill[ort]", "hidden_states", 12.3, 12.0, None, None, None).passed  # fp32: absolute only
    assert not OutputCheck("step", "logits", 0.1, 12.0, False, 0.5, 0.01).passed
    assert QUANTIZED_REL_L2 < 0.5
