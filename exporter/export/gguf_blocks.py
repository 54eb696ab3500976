"""The source GGUF's own 4-bit blocks, kept as they are for the ``ort`` graph.

The embedded SmolLM2 ships as ``Q4_1``: every decoder-layer weight is stored in blocks of 32 values
along the input axis, ``w = d * q + m`` with a 4-bit ``q`` and fp16 ``d`` and ``m`` per block.
transformers dequantizes these to fp32 on load, and the fp32 graph then reads 4.5x more bytes per
step than the file holds. A decode step on this CPU is bound by memory bandwidth (~24 GB/s on 2
cores: the 540 MB of fp32 weights alone take ~22 ms), so the ``ort`` graph keeps the blocks instead:

    x . w  =  sum_b d_b (x_b . q_b)  +  sum_b m_b (sum of x_b)
           =  Gemm(block sums of x, M, C = MatMulNBits(x; q, scale d, zero point 0))

``MatMulNBits`` (accuracy level 0: it dequantizes to fp32 and multiplies in fp32) computes the first
term from the same ``d * q`` products transformers computes; the second term adds the block minima.
These are the same weights the fp32 graph multiplies, not an approximation of them. Only the fp32
rounding differs: transformers rounds ``d * q + m`` once per weight, this graph adds ``m`` after the
dot product. The logits agree with the torch reference to ~1e-4, like the fp32 graph (checked by
``specdeploy validate``), and a weight that does not decode to exactly transformers' value refuses
the whole path (see :func:`read_q4_1_linears`).

The tied embedding / lm_head (``Q8_0``) stays fp32: its dequantized values are exact in fp32, and
ONNX Runtime's 8-bit fp32-compute kernel is far slower than an fp32 MatMul on this CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32
_GGUF_LINEARS = {  # GGUF tensor suffix -> transformers module path inside model.layers.{i}
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Q4Blocks:
    """One weight ``[N, K]`` (transformers' orientation) as 4-bit blocks along K."""

    q: np.ndarray  # [N, K] uint8 values 0..15
    d: np.ndarray  # [N, K/32] float32 block scales
    m: np.ndarray  # [N, K/32] float32 block minima

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        """The fp32 weights exactly as gguf (and so transformers) computes them: ``d * q + m``."""
        n, k = self.q.shape
        q = self.q.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
        return (self.d[..., None] * q + self.m[..., None]).reshape(n, k)

    @staticmethod
    def concat(parts: list[Q4Blocks]) -> Q4Blocks:
        """Blocks of weights stacked along N (the fused q/k/v or gate/up projection)."""
        return Q4Blocks(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))

    def matmulnbits_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(B [N, K/32, 16] uint8, scales [N*K/32] float32, zero points [N*ceil(K/64)] uint8 of 0).

        ONNX Runtime packs element 2i in the low nibble and 2i+1 in the high nibble of each byte
        (GGUF packs element i with element i+16, hence the repacking).
        """
        n, k = self.q.shape
        blocks = k // BLOCK
        q = self.q.reshape(n, blocks, BLOCK // 2, 2)
        packed = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)  # [N, blocks, 16]
        zero_points = np.zeros(n * ((blocks + 1) // 2), dtype=np.uint8)
        return packed, self.d.reshape(-1).astype(np.float32), zero_points


def _parse_q4_1(raw: np.ndarray, n: int, k: int) -> Q4Blocks:
    """Split GGUF Q4_1 bytes (20 per block: fp16 d, fp16 m, 16 bytes of nibbles) into arrays."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]  # [N, blocks, 16]: low nibble = element j, high nibble = element j + 16
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return Q4Blocks(q, d, m)


def _row_order(gguf_rows: np.ndarray, hf_rows: np.ndarray) -> np.ndarray | None:
    """The permutation p with ``gguf_rows[p] == hf_rows`` bit for bit, or None when there is none.

    llama.cpp's converter permutes the rows of q_proj and k_proj (for its rotary layout) and
    transformers' GGUF loader undoes it; matching rows by their bytes finds that permutation
    without re-deriving it, and proves every row decodes to exactly transformers' weights.
    """
    index: dict[bytes, int] = {}
    for i, row in enumerate(gguf_rows):
        index.setdefault(row.tobytes(), i)
    order = [index.get(row.tobytes()) for row in hf_rows]
    if any(o is None for o in order) or len(set(order)) != len(order):
        return None
    return np.asarray(order)


def read_q4_1_linears(gguf_path: str | Path, model) -> dict[str, Q4Blocks] | None:
    """Every decoder-layer linear of ``model`` as its GGUF Q4_1 blocks, keyed by transformers name.

    Returns None (the caller writes fp32 weights instead) unless every linear weight is Q4_1, has no
    bias, and decodes bit for bit to the weight ``model`` holds.
    """
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    params = dict(model.named_parameters())
    out: dict[str, Q4Blocks] = {}
    for i in range(model.config.num_hidden_layers):
        for suffix, module in _GGUF_LINEARS.items():
            t = tensors.get(f"blk.{i}.{suffix}.weight")
            name = f"model.layers.{i}.{module}"
            weight = params.get(f"{name}.weight")
            if t is None or weight is None or f"{name}.bias" in params or t.tensor_type != GGMLQuantizationType.Q4_1:
                return None
            n, k = weight.shape
            if k % BLOCK:
                return None
            blocks = _parse_q4_1(t.data, n, k)
            order = _row_order(blocks.dequantize(), weight.detach().float().cpu().numpy())
            if order is None:
                return None
            out[name] = Q4Blocks(blocks.q[order], blocks.d[order], blocks.m[order])
    return out
