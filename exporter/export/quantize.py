"""Weight precision of an exported base graph: 8- and 4-bit weight-only quantization with ONNX Runtime's tools.

``specdeploy export base --precision int4`` traces the fp32 graph as usual, then rewrites every MatMul
whose weight is a constant into ONNX Runtime's ``MatMulNBits`` (``com.microsoft``) with
:class:`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`: weights are stored as
blocks of ``block_size`` values along K with one scale each; the kernel quantizes its activations to
int8 on the fly (accuracy level 4), while everything between the MatMuls and the KV cache stay fp32.
The graph's inputs and outputs keep their dtypes, so the runtime's ``OrtBackend`` runs it unchanged;
only ONNX Runtime can, so such a graph is target ``ort`` (TensorRT gets its precision from its own
build flags instead: ``specdeploy build --precision fp16``).

The tied lm_head. The dynamo graph computes the logits as ``MatMul(hidden, Transpose(embed))``: the
embedding table feeds both the token ``Gather`` and, transposed, the logits. The quantizer only touches
a MatMul whose weight is an initializer, so :func:`untie_lm_head` folds that Transpose into a
``[H, V]`` initializer of its own first; the ``Gather`` keeps the float table. (ONNX Runtime folds the
Transpose into such a copy at session start anyway, so this costs no memory at run time.)

The defaults were chosen by measurement on SmolLM2-135M-Instruct (teacher-forced top-1 agreement with
fp32 and perplexity on ``quality.HELD_IN_TEXTS``, 394 positions, fp32 ppl 16.22; step times are T=1
decode steps at 2 threads, capacity 256, min over interleaved rounds on a shared, busy 2-core machine:
only their order is meaningful; fp32 measured 64 ms there). "acc" is MatMulNBits' ``accuracy_level``:
0 computes in fp32, 4 quantizes the activations to int8 inside the kernel.

===============================================  ======  =====  ============  ==================
int4 variant (symmetric unless said)             top-1   ppl    step (noisy)  spec == plain
===============================================  ======  =====  ============  ==================
block 32, acc 4, lm_head int4 acc 4  (default)   0.62    21.9   31-37 ms
block 32, acc 4, lm_head int8 acc 4              0.69    20.3   32-40 ms      NO: 5 of 12 differ
block 32, acc 0, lm_head int8 acc 4              0.69    20.1   43-48 ms      yes: 20 of 20
block 32, acc 0, lm_head int4 acc 0              0.62    21.6   40-48 ms      yes: 12 of 12
block 32, acc 0, lm_head fp32                    0.70    20.0   46-57 ms
asymmetric, block 32, acc 4, lm_head int8        0.70    20.7   35-40 ms
block 16, acc 4, lm_head int8                    0.74    20.1   44-52 ms
HQQ block 32 (float zero points)                 0.78    17.5   670 ms (no fast CPU kernel)
===============================================  ======  =====  ============  ==================

"spec == plain": prompt-lookup (auto tree and tree16) against plain greedy, MT-bench prompts, 64 tokens,
measured before the runtime's step plans (below), which make the acc-4 rows identical too.

Why int8 activations broke the identity, and what restores it. Measured on this graph (logits of the
same tokens, bitwise): a 1-row step computed row 0 differently from a step of two or more rows (acc 4:
logits differ by up to 0.15; fp32: 2e-5), while the rows of any step with >= 2 rows are bitwise the
same whatever their number (T = 2, 3, 6 agree exactly, fp32 and acc 4). The only node whose 1-row
result differs is GroupQueryAttention (MatMulNBits at acc 4, the norms and SiLU compute a row the same
for any row count), so the ``ort`` graph pads a 1-row step's attention to two rows itself
(``exporter/ort_graph.py``). A tree node whose ancestors are not adjacent cache slots differs too (the
attention softmax sums its window with the masked slots in between, in another order). In fp32 these
are 1e-5 and harmless in practice; int8 activations requantize them in every layer into flipped
roundings, so near-tied argmaxes flip. These were kernel properties of one Intel Xeon (AVX-512 VNNI):
on an AMD EPYC with AVX2 only, the int4 and q4_1 graphs' 1-row steps differ from 2-row steps even with
the padding (MatMulNBits' 1-row path). So the runtime assumes none of this: at load it probes, bit
for bit, which step plan keeps verified rows equal to plain rows on the machine (``runtime/plan.py``):
1-row steps, or every step with >= 2 rows (a plain step carries a dummy row), with drafts cut to
chains where a tree's rows differ.

So int4 is onnxruntime-genai's int4 recipe (symmetric blocks of 32, int8 activations, lm_head int4
with int8 activations): the fastest CPU kernels, and lossless through the probed step plan. Without the attention padding our graph takes genai's time per
1-row step (CPU time 17.3 against 17.5 ms at past 256, interleaved); the padding adds ~10% (19.0 ms).
``QuantConfig``
still builds the fp32-compute variants of the table for measurements.

int8 (block 32, lm_head int8): top-1 0.95, ppl 16.31 at acc 4; 0.967 / 16.23 at acc 0, whose 8-bit
CPU path dequantizes on every call (~16x slower than fp32), so int8 keeps acc 4, like int4.

int4 loses more here than usual because SmolLM2's fp32 weights are themselves dequantized Q4_1 (the
embedded GGUF): rounding them onto another 4-bit grid adds a second rounding error of the same size.
onnxruntime-genai's int4 builder (symmetric, block 32, acc 4, lm_head int4) rounds the same way.
The ``q4_1`` precision (``export_base``) avoids that second rounding: it keeps the GGUF's own blocks
(``gguf_blocks.py``) with int8 activations and the lm_head's own Q8_0 blocks at 8 bits: top-1 0.924 and
perplexity 16.16 against fp32's 16.22, for a 1-row step ~1.25x int4's (the block-minimum MatMuls). The
``gguf`` precision does the same for any GGUF's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks.

This module is export-time only; the runtime never imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.precision import EXPORT_PRECISIONS, FP16, INT4, INT8, QUANTIZED

TARGETS = ("trt", "ort", "all")
CONTRIB_DOMAIN = "com.microsoft"


class PrecisionError(SpecDeployError):
    """A precision/target combination that cannot be exported."""


@dataclass(frozen=True)
class QuantConfig:
    """How the MatMul weights of a graph are quantized (weight-only, blockwise along K)."""

    bits: int  # 4 or 8
    block_size: int = 32  # values per scale; a power of two >= 16
    symmetric: bool = True  # no zero points: measured as good as asymmetric here, and smaller
    accuracy_level: int = 0  # MatMulNBits compute type: 0 = as the input (fp32), 4 = int8 activations
    lm_head_bits: int = 8  # the logits MatMul (its own copy; the embedding Gather stays float); 0 = keep fp32
    lm_head_accuracy_level: int = 4  # the lm_head's compute type (see accuracy_level)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise PrecisionError(f"Weight-only quantization takes 4 or 8 bits, not {self.bits}.")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise PrecisionError(f"--block-size must be a power of two >= 16, not {self.block_size}.")
        if self.lm_head_bits not in (0, 4, 8):
            raise PrecisionError(f"lm_head_bits must be 0 (fp32), 4 or 8, not {self.lm_head_bits}.")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise PrecisionError(f"accuracy_level must be 0..4, not {self.accuracy_level}.")


# Measured defaults per precision (see the module docstring).
QUANT_DEFAULTS = {INT8: QuantConfig(8, accuracy_level=4),
                  INT4: QuantConfig(4, accuracy_level=4, lm_head_bits=4, lm_head_accuracy_level=4)}



def resolve_target(precision: str, target: str | None) -> str:
    """The graph target(s) for ``precision``: both for fp32 by default; quantized graphs are ONNX Runtime only."""
    if precision not in EXPORT_PRECISIONS:
        raise PrecisionError(f"Unknown precision '{precision}'; choose one of {', '.join(EXPORT_PRECISIONS)}.")
    if target is not None and target not in TARGETS:
        raise PrecisionError(f"Unknown target '{target}'; choose one of {', '.join(TARGETS)}.")
    if precision == FP16:
        raise PrecisionError(
            "--precision fp16 is not exported: on ONNX Runtime's CPU provider fp16 only pays in the weight-bound "
            "MatMuls, its Softmax/Pow/Sigmoid kernels run 1.2-1.7x slower than fp32, and --precision int8 "
            "shrinks the weights further at fp32-like quality. For a GPU, export fp32 and build TensorRT "
            "engines with 'specdeploy build --precision fp16'."
        )
    if precision in QUANTIZED:
        if target in ("trt", "all"):
            raise PrecisionError(
                f"--precision {precision} uses ONNX Runtime's MatMulNBits contrib op, which TensorRT cannot parse; "
                "use --target ort, or export fp32 for TensorRT and pick its precision with 'specdeploy build'."
            )
        return "ort"
    return target or "all"


def quant_config(precision: str, block_size: int | None = None, **overrides) -> QuantConfig:
    """The measured defaults for ``precision`` ("int8"/"int4"), with an optional block size."""
    if precision not in QUANT_DEFAULTS:
        raise PrecisionError(f"Precision '{precision}' is not a weight-only quantization (int8, int4).")
    cfg = QUANT_DEFAULTS[precision]
    if block_size is not None:
        overrides["block_size"] = block_size
    return replace(cfg, **overrides) if overrides else cfg


def untie_lm_head(model) -> str | None:
    """Fold ``Transpose(initializer)`` feeding a MatMul into a transposed initializer of its own.

    Returns the name of the MatMul computing the logits (the graph output ``logits`` is downstream
    of it), or None when the graph has no such Transpose (an untied lm_head is already an initializer).
    Modifies ``model`` in place; the original initializer stays for the embedding Gather.
    """
    import numpy as np
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    lm_matmul = None
    for node in list(graph.node):
        if node.op_type != "Transpose" or node.input[0] not in inits:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        users = consumers.get(node.output[0], [])
        if perm != [1, 0] or not users or any(u.op_type != "MatMul" or u.input[1] != node.output[0] for u in users):
            continue
        weight = numpy_helper.to_array(inits[node.input[0]])  # [V, H] (the embedding table)
        folded = numpy_helper.from_array(np.ascontiguousarray(weight.T), f"{node.input[0]}.T")  # [H, V]
        graph.initializer.append(folded)
        for u in users:
            u.input[1] = folded.name
        graph.node.remove(node)
        if weight.shape[0] > weight.shape[1]:  # V > H: the vocabulary projection
            lm_matmul = users[0].name
    if lm_matmul is None:  # an untied (or op-by-op written) lm_head: the MatMul producing the logits
        lm_matmul = next((n.name for n in graph.node
                          if n.op_type == "MatMul" and "logits" in n.output and n.input[1] in inits), None)
    return lm_matmul


def _matmul_nbits(model, bits: int, block_size: int, symmetric: bool, accuracy_level: int, exclude: list[str]):
    """ONNX Runtime's MatMulNBitsQuantizer over every constant-weight MatMul of ``model`` but ``exclude``.

    (Its ``nodes_to_include`` adds to its own choice rather than limiting it, so exclusion is the way.)
    """
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # The quantizer logs one INFO line per node it skips; keep the export's progress readable.
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                                     accuracy_level=accuracy_level, nodes_to_exclude=exclude)
    quantizer.process()
    return quantizer.model.model


def quantize_model(model, config: QuantConfig):
    """Return ``model`` (an onnx.ModelProto with weights loaded) with MatMul weights in MatMulNBits."""
    lm_head = untie_lm_head(model)

    def run(model, bits: int, accuracy_level: int, exclude: list[str]):
        return _matmul_nbits(model, bits, config.block_size, config.symmetric, accuracy_level, exclude)

    # Pass 1: every constant-weight MatMul but the lm_head; pass 2: the lm_head at its own width (the
    # only constant-weight MatMul left; the attention MatMuls multiply activations and are skipped).
    out = run(model, config.bits, config.accuracy_level, [lm_head] if lm_head else [])
    if lm_head and config.lm_head_bits:
        out = run(out, config.lm_head_bits, config.lm_head_accuracy_level, [])
    if not any(n.op_type == "MatMulNBits" for n in out.graph.node):
        raise PrecisionError("No MatMul weight was quantized; the graph has no constant-weight MatMul.")
    levels = {next((a.i for a in n.attribute if a.name == "accuracy_level"), 0)  # 0 when unset
              for n in out.graph.node if n.op_type == "MatMulNBits"}
    if levels != {4}:
        drop_row_exact_claim(out)  # fp32-activation MatMulNBits has its own 1-row path
    return out


def drop_row_exact_claim(model) -> None:
    """Remove the graph's claim that its 1-row steps are row-exact (``GraphEntry.attention_rows``)."""
    from specdeploy.exporter.export.ort_graph import ATTENTION_ROWS_KEY

    kept = [p for p in model.metadata_props if p.key != ATTENTION_ROWS_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)


def quantize_file(src: Path, dst: Path, config: QuantConfig) -> None:
    """Quantize the graph at ``src`` into ``dst`` (weights in ``<dst name>.data`` next to it)."""
    import onnx
    from specdeploy.exporter.export.ort_graph import save_graph

    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src), load_external_data=True)
    save_graph(quantize_model(model, config), dst)


@dataclass(frozen=True)
class GraphQuantization:
    """What a graph's MatMulNBits nodes say about its quantization (for reports and tests)."""

    matmuls: int  # MatMulNBits nodes
    bits: int  # of the decoder-layer weights
    block_size: int
    symmetric: bool  # no zero points anywhere
    accuracy_level: int
    lm_head_bits: int  # 0: the logits MatMul is fp32


def graph_quantization(path: Path, vocab_size: int) -> GraphQuantization | None:
    """Read the quantization of the graph at ``path`` (None when it has no MatMulNBits)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    nodes = [(n, {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute})
             for n in model.graph.node if n.op_type == "MatMulNBits"]
    if not nodes:
        return None
    lm = [a for _, a in nodes if a.get("N") == vocab_size]
    layers = [a for _, a in nodes if a.get("N") != vocab_size] or lm
    return GraphQuantization(
        matmuls=len(nodes),
        bits=int(layers[0]["bits"]),
        block_size=int(layers[0]["block_size"]),
        symmetric=all(len(n.input) < 4 or not n.input[3] for n, _ in nodes),
        accuracy_level=int(layers[0].get("accuracy_level", 0)),
        lm_head_bits=int(lm[0]["bits"]) if lm else 0,
    )
