"""Weight precision of an exported base graph: 8- and 4-bit weight-only quantization with ONNX Runtime's tools.

``specdeploy export base --precision int4`` traces the fp32 graph as usual, then rewrites every MatMul
whose weight is a constant into ONNX Runtime's ``MatMulNBits`` (``com.microsoft``) with
:class:`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`: weights are stored as
blocks of ``block_size`` values along K with one scale each, activations and the KV cache stay fp32.
The graph's inputs and outputs keep their dtypes, so the runtime's ``OrtBackend`` runs it unchanged;
only ONNX Runtime can, so such a graph is target ``ort`` (TensorRT gets its precision from its own
build flags instead: ``specdeploy build --precision fp16``).

The tied lm_head. The dynamo graph computes the logits as ``MatMul(hidden, Transpose(embed))``: the
embedding table feeds both the token ``Gather`` and, transposed, the logits. The quantizer only touches
a MatMul whose weight is an initializer, so :func:`untie_lm_head` folds that Transpose into a
``[H, V]`` initializer of its own first; the ``Gather`` keeps the float table. (ONNX Runtime folds the
Transpose into such a copy at session start anyway, so this costs no memory at run time.)

The defaults come from measurements on SmolLM2-135M-Instruct (see ``QUANT_DEFAULTS`` and the issue
thread): symmetric blocks of 32 and ``accuracy_level`` 4 (int8 activations inside the kernel, the CPU
setting onnxruntime-genai's model builder also uses), lm_head quantized too.

This module is export-time only; the runtime never imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from specdeploy.runtime.errors import SpecDeployError

PRECISIONS = ("fp32", "fp16", "int8", "int4")
QUANTIZED = {"int8": 8, "int4": 4}
TARGETS = ("trt", "ort")
CONTRIB_DOMAIN = "com.microsoft"


class PrecisionError(SpecDeployError):
    """A precision/target combination that cannot be exported."""


@dataclass(frozen=True)
class QuantConfig:
    """How the MatMul weights of a graph are quantized (weight-only, blockwise along K)."""

    bits: int  # 4 or 8
    block_size: int = 32  # values per scale; a power of two >= 16
    symmetric: bool = True  # no zero points: measured as good as asymmetric here, and smaller
    accuracy_level: int = 4  # MatMulNBits compute type: 0 = as the input (fp32), 4 = int8 activations
    quantize_lm_head: bool = True  # the logits MatMul too (its own copy; the embedding Gather stays float)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise PrecisionError(f"Weight-only quantization takes 4 or 8 bits, not {self.bits}.")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise PrecisionError(f"--block-size must be a power of two >= 16, not {self.block_size}.")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise PrecisionError(f"accuracy_level must be 0..4, not {self.accuracy_level}.")


# Measured defaults per precision (see the module docstring).
QUANT_DEFAULTS = {"int8": QuantConfig(8), "int4": QuantConfig(4)}


def resolve_target(precision: str, target: str | None) -> str:
    """The graph target for ``precision``: quantized graphs are ONNX Runtime only."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"Unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}.")
    if target is not None and target not in TARGETS:
        raise PrecisionError(f"Unknown target '{target}'; choose one of {', '.join(TARGETS)}.")
    if precision == "fp16":
        raise PrecisionError(
            "--precision fp16 is not exported: ONNX Runtime's CPU execution provider has no fp16 kernels for "
            "most of this graph (MatMul, Softmax, ReduceMean...) and runs fp16 slower than fp32 where it has "
            "them. For a GPU, export fp32 and build TensorRT engines with 'specdeploy build --precision fp16'."
        )
    if precision in QUANTIZED:
        if target == "trt":
            raise PrecisionError(
                f"--precision {precision} uses ONNX Runtime's MatMulNBits contrib op, which TensorRT cannot parse; "
                "use --target ort, or export fp32 for TensorRT and pick its precision with 'specdeploy build'."
            )
        return "ort"
    return target or "trt"


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
    return lm_matmul


def quantize_model(model, config: QuantConfig):
    """Return ``model`` (an onnx.ModelProto with weights loaded) with MatMul weights in MatMulNBits."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    lm_head = untie_lm_head(model)
    exclude = [lm_head] if lm_head and not config.quantize_lm_head else []
    # The quantizer logs one INFO line per node it skips; keep the export's progress readable.
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=config.bits,
        block_size=config.block_size,
        is_symmetric=config.symmetric,
        accuracy_level=config.accuracy_level,
        nodes_to_exclude=exclude,
    )
    quantizer.process()
    out = quantizer.model.model
    if not any(n.op_type == "MatMulNBits" for n in out.graph.node):
        raise PrecisionError("No MatMul weight was quantized; the graph has no constant-weight MatMul.")
    return out


def quantize_file(src: Path, dst: Path, config: QuantConfig) -> None:
    """Quantize the graph at ``src`` into ``dst`` (weights in ``<dst name>.data`` next to it)."""
    import onnx

    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src), load_external_data=True)
    model = quantize_model(model, config)
    data = dst.with_name(dst.name + ".data")
    if data.exists():  # onnx appends to an existing external-data file
        data.unlink()
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)


def graph_quantization(path: Path) -> dict[str, object]:
    """What a bundle graph's MatMulNBits nodes say about its quantization (for reports)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    if not nodes:
        return {}
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    lm = any(dict((a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute).get("N", 0) > 8192
             for n in nodes)
    return {
        "matmuls": len(nodes),
        "bits": int(attrs.get("bits", 4)),
        "block_size": int(attrs.get("block_size", 0)),
        "symmetric": all(len(n.input) < 4 or not n.input[3] for n in nodes),
        "accuracy_level": int(attrs.get("accuracy_level", 0)),
        "lm_head": lm,
    }
