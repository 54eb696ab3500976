"""Precisions: the one table of what each precision name means and where it applies.

A bundle's base graph records its precision (``GraphEntry.precision``); ``export base --precision``,
``export draft --precision`` and ``build --precision`` each accept a subset of this table.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32, FP16, BF16 = "fp32", "fp16", "bf16"
INT8, INT4 = "int8", "int4"
Q4_1 = "q4_1"
GGUF = "gguf"
GGUF_Q4_1_BLOCKS = "gguf-q4_1"


@dataclass(frozen=True)
class Precision:
    name: str
    weights: str  # what the graph stores
    activations: str  # what its matrix products multiply in
    quantized: bool  # rounded away from the fp32 model: compared with looser tolerances, gated on quality


TABLE: dict[str, Precision] = {p.name: p for p in (
    Precision(FP32, "fp32", "fp32", False),
    Precision(FP16, "fp16 (TensorRT engines)", "fp16", False),
    Precision(BF16, "bf16 (TensorRT engines)", "bf16", False),
    Precision(INT8, "int8 blocks (MatMulNBits), lm_head int8", "int8", True),
    Precision(INT4, "int4 blocks (MatMulNBits), lm_head int4", "int8", True),
    Precision(Q4_1, "a Q4_1 GGUF's own 4-bit blocks, lm_head from its Q8_0 table at 8 bits", "int8", True),
    # Any GGUF: Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks kept at 4 or 8 bits, others re-quantized to 8 bits.
    Precision(GGUF, "a GGUF's own blocks at 4 or 8 bits (others 8-bit), embedding and lm_head too", "int8", True),
    # The 1-row graph of an fp32 bundle exported from a Q4_1 GGUF (the ``split`` step plan).
    Precision(GGUF_Q4_1_BLOCKS, "a Q4_1 GGUF's own 4-bit blocks, lm_head fp32", "fp32", True),
)}

EXPORT_PRECISIONS = (FP32, FP16, INT8, INT4, Q4_1, GGUF)  # export base (fp16 is refused with a pointer to build)
MATMULNBITS_BITS = {INT8: 8, INT4: 4}  # what our quantizer writes from fp32 weights
DRAFT_PRECISIONS = (INT8, INT4, FP32)  # export draft (Chimera, Medusa, Cerberus)
QUANTIZED_DRAFT_PRECISIONS = (INT4, INT8)  # the CPU drafter's preference, first to last
ENGINE_PRECISIONS = (FP32, FP16, BF16)  # build (TensorRT)
QUANTIZED = frozenset(name for name, p in TABLE.items() if p.quantized)
