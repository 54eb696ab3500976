"""The source GGUF's own blocks, kept as they are for the ``ort`` graph.

A GGUF stores each weight in blocks along the input axis K, ``w = scale * (q - zero) + minimum`` with a
small integer ``q`` per value and a scale (and for some formats a minimum) per block. transformers
dequantizes them to fp32 on load, and an fp32 graph then reads 4-7x more bytes per step than the file
holds. A decode step on these CPUs is bound by memory bandwidth, so the ``ort`` graph keeps the blocks:

=======  =================================  ============================================
format   block of K                         held in ``MatMulNBits`` as
=======  =================================  ============================================
Q4_0     32: fp16 d, q 0..15                4 bits, zero point 8, scale d
Q4_1     32: fp16 d and m, q 0..15          4 bits, zero point 0, scale d; + m term
Q5_0     32: fp16 d, q 0..31                8 bits, zero point 16, scale d
Q8_0     32: fp16 d, int8 q                 8 bits, zero point 128, scale d
Q4_K     256 = 8 x 32: 6-bit sub-scales     4 bits per 32, zero point 0, scale d*sc; + min
Q6_K     256 = 16 x 16: int8 sub-scales     8 bits per 16, zero point 32, scale d*sc
=======  =================================  ============================================

The "m term" of the formats with a block minimum is ``sum_b m_b (sum of x over block b)``: one ``Gemm``
of x's block sums with the minima, added onto the ``MatMulNBits`` output (``ort_graph.block_linear``).
Every scale above is exact in fp32 (an fp16 times a small integer), so these are the same weights
transformers computes, not a second rounding of them; each row is checked to decode bit for bit to the
model's weight, and a tensor that does not (or a format not in the table) is re-quantized instead
(:func:`requantize`, 8-bit symmetric blocks of 32, reported in the manifest).

The token embedding is held too (``embedding_planes``): its rows are gathered as packed integers and
decoded inside the graph, for the few rows of a step, instead of an fp32 table of vocabulary x hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from specdeploy.runtime.architectures import architecture

BLOCK = 32
QK_K = 256  # values per super-block of the K-quants
_GGUF_LINEARS = {  # GGUF tensor suffix -> transformers module path inside model.layers.{i}
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
REQUANTIZED = "requantized-8bit"  # how a tensor whose blocks could not be kept is held


@dataclass(frozen=True)
class Blocks:
    """One weight ``[N, K]`` (transformers' orientation) as ``scale * (q - zero) + minimum`` per block along K."""

    q: np.ndarray  # [N, K] uint8, 0 .. 2**bits - 1
    scale: np.ndarray  # [N, K/block] float32
    minimum: np.ndarray | None  # [N, K/block] float32 added after the product (Q4_1, Q4_K), or None
    zero: int  # the one zero point of every block
    bits: int  # the width MatMulNBits stores: 4 or 8
    block: int  # values per scale
    kind: str  # the GGUF format it came from, or REQUANTIZED

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def layout(self) -> tuple:
        """What must agree for two weights to be stacked into one MatMulNBits."""
        return self.bits, self.block, self.zero, self.minimum is not None

    def dequantize(self) -> np.ndarray:
        """The fp32 weights, with gguf's own operations (so bit for bit what transformers loads)."""
        n, k = self.q.shape
        q = self.q.reshape(n, k // self.block, self.block).astype(np.float32)
        if self.zero:
            q = q - np.float32(self.zero)
        w = self.scale[..., None] * q
        if self.minimum is not None:
            w = w + self.minimum[..., None]
        return w.reshape(n, k)

    def rows(self, order: np.ndarray) -> Blocks:
        return Blocks(self.q[order], self.scale[order], None if self.minimum is None else self.minimum[order],
                      self.zero, self.bits, self.block, self.kind)

    @staticmethod
    def concat(parts: list[Blocks]) -> Blocks:
        """Weights of one layout stacked along N (the fused q/k/v or gate/up projection)."""
        first = parts[0]
        assert all(p.layout == first.layout for p in parts)
        minimum = None if first.minimum is None else np.concatenate([p.minimum for p in parts])
        kinds = sorted({p.kind for p in parts})
        return Blocks(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]), minimum,
                      first.zero, first.bits, first.block, "+".join(kinds))

    def matmulnbits_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(B [N, K/block, block*bits/8] uint8, scales [N*K/block] float32, zero points uint8).

        4 bits: element 2i in the low nibble and 2i+1 in the high nibble of a byte (GGUF pairs element i
        with i+16 instead, hence the repacking); zero points two per byte, each row padded to whole bytes.
        """
        n, k = self.q.shape
        blocks = k // self.block
        if self.bits == 8:
            return (self.q.reshape(n, blocks, self.block), self.scale.reshape(-1).astype(np.float32),
                    np.full(n * blocks, self.zero, np.uint8))
        q = self.q.reshape(n, blocks, self.block // 2, 2)
        packed = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)
        zero_points = np.full(n * ((blocks + 1) // 2), self.zero | (self.zero << 4), np.uint8)
        return packed, self.scale.reshape(-1).astype(np.float32), zero_points


# --- the formats ---------------------------------------------------------------------------------
def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis' two bytes, as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: element j in the low nibble of byte j, element j + 16 in its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> tuple:
    return _nibbles(b[..., 2:]), _f16(b[..., 0:2]), None, 8, 4, BLOCK


def _q4_1(b: np.ndarray) -> tuple:
    return _nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 0, 4, BLOCK


def _q5_0(b: np.ndarray) -> tuple:
    qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # [.., 1]: bit j is element j's fifth bit
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(b[..., 6:]) | (high << 4), _f16(b[..., 0:2]), None, 16, 8, BLOCK


def _q8_0(b: np.ndarray) -> tuple:
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, _f16(b[..., 0:2]), None, 128, 8, BLOCK


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> eight 6-bit sub-block scales and eight 6-bit minima."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b: np.ndarray) -> tuple:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scale_min(b[..., 4:16])
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 32)  # 4 groups of 32 bytes: sub-blocks 2g (low), 2g+1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], QK_K)
    return q, d[..., None] * sc, -(dmin[..., None] * mn), 0, 4, BLOCK


def _q6_k(b: np.ndarray) -> tuple:
    ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    lead = b.shape[:-1]
    low = ql.reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    low = (low & 0x0F).reshape(*lead, 8, 32)
    high = qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = (high & 0x03).reshape(*lead, 8, 32)
    q = (low | (high << 4)).reshape(*lead, QK_K)
    return q, d[..., None] * sc.view(np.int8).astype(np.float32), None, 32, 8, 16


# name -> (values per block of bytes, bytes per block, parser of [..., bytes] -> per-block arrays)
FORMATS = {
    "Q4_0": (BLOCK, 18, _q4_0),
    "Q4_1": (BLOCK, 20, _q4_1),
    "Q5_0": (BLOCK, 22, _q5_0),
    "Q8_0": (BLOCK, 34, _q8_0),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q6_K": (QK_K, 210, _q6_k),
}


def parse(raw: np.ndarray, kind: str, n: int, k: int) -> Blocks | None:
    """A GGUF tensor's bytes (``kind`` blocks of a row-major [n, k] weight) as :class:`Blocks`, or None
    when the format is not one MatMulNBits can hold or k is not a whole number of its blocks."""
    if kind not in FORMATS:
        return None
    values, size, parser = FORMATS[kind]
    if k % values:
        return None
    b = np.asarray(raw, dtype=np.uint8).reshape(n, k // values, size)
    q, scale, minimum, zero, bits, block = parser(b)
    per_row = k // block
    return Blocks(q.reshape(n, k).astype(np.uint8), scale.reshape(n, per_row).astype(np.float32),
                  None if minimum is None else minimum.reshape(n, per_row).astype(np.float32),
                  zero, bits, block, kind)


def requantize(weight: np.ndarray) -> Blocks:
    """An fp32 weight ``[N, K]`` as 8-bit symmetric blocks of 32: a second rounding, for tensors whose own
    blocks cannot be kept (K must be a multiple of 32)."""
    n, k = weight.shape
    w = weight.reshape(n, k // BLOCK, BLOCK)
    scale = (np.abs(w).max(axis=-1) / 127).astype(np.float32)
    safe = np.where(scale == 0, 1, scale)
    q = np.clip(np.rint(w / safe[..., None]), -127, 127).astype(np.int16) + 128
    return Blocks(q.reshape(n, k).astype(np.uint8), scale, None, 128, 8, BLOCK, REQUANTIZED)


def gguf_row_order(rows: int, heads: int) -> np.ndarray:
    """The order p with ``gguf[p] == transformers'`` rows of a q_proj or k_proj that llama.cpp's converter
    permuted for its rotary layout (each head's two halves ``(2, D/2)`` interleaved as ``(D/2, 2)``), as
    transformers' GGUF loader undoes it and the GPU check's reader (``gpu_real.read_gguf``) does too."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


@dataclass(frozen=True)
class GgufWeights:
    """What a GGUF's blocks give the graph: every decoder linear (kept or re-quantized), the embedding
    and the lm_head where their blocks decode exactly, and how each tensor is held (for the manifest)."""

    linears: dict[str, Blocks]  # transformers module path -> its weight's blocks
    embedding: Blocks | None  # [V, H], or None (the graph keeps the fp32 table)
    lm_head: Blocks | None  # [V, H], or None
    held: tuple[tuple[str, str], ...]  # (GGUF tensor name, its format or REQUANTIZED), in file order

    def kept(self) -> dict[str, int]:
        """Tensors per format kept as they are."""
        out: dict[str, int] = {}
        for _, how in self.held:
            if how not in (REQUANTIZED, "fp32"):
                out[how] = out.get(how, 0) + 1
        return out

    def requantized(self) -> list[str]:
        return [name for name, how in self.held if how == REQUANTIZED]


def _exact(blocks: Blocks | None, weight: np.ndarray, order: np.ndarray | None = None) -> Blocks | None:
    """``blocks`` (rows ``order`` of them, where given) if they decode bit for bit to ``weight``, else None: every
    kept weight is proven to be exactly transformers' own."""
    if blocks is None or blocks.shape != weight.shape:
        return None
    decoded = blocks.dequantize()
    if not np.array_equal(decoded if order is None else decoded[order], weight):
        return None
    return blocks if order is None else blocks.rows(order)


def read_gguf_weights(gguf_path: str | Path, model, only: frozenset[str] | None = None) -> GgufWeights | None:
    """The blocks of ``model``'s weights in the GGUF it was loaded from.

    A decoder linear whose format is in ``only`` (default: every format of :data:`FORMATS`) and decodes
    bit for bit to ``model``'s weight keeps its blocks; any other is re-quantized (:func:`requantize`).
    With ``only`` given, returns None unless every decoder linear kept its blocks (the ``q4_1`` precision).
    The embedding keeps its blocks when they decode exactly (else the graph keeps the fp32 table); the
    lm_head too, when its format has no block minimum (else it is re-quantized).
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    params = dict(model.named_parameters())

    cfg = model.config
    permuted = architecture(cfg).gguf_qk_permuted  # q/k rows in llama.cpp's rotary order
    heads = {"attn_q": int(cfg.num_attention_heads), "attn_k": int(cfg.num_key_value_heads)}

    def blocks_of(tensor_name: str, weight: np.ndarray, formats) -> Blocks | None:
        t = tensors.get(tensor_name)
        if t is None or t.tensor_type.name not in formats:
            return None
        n, k = weight.shape
        kind = tensor_name.split(".")[-2]
        order = gguf_row_order(n, heads[kind]) if permuted and kind in heads else None
        return _exact(parse(t.data, t.tensor_type.name, n, k), weight, order)

    linear_formats = set(FORMATS) if only is None else set(only)
    linears: dict[str, Blocks] = {}
    held: dict[str, str] = {}
    for i in range(model.config.num_hidden_layers):
        for suffix, module in _GGUF_LINEARS.items():
            name, tensor = f"model.layers.{i}.{module}", f"blk.{i}.{suffix}.weight"
            param = params.get(f"{name}.weight")
            if param is None:
                return None
            weight = param.detach().float().cpu().numpy()
            blocks = blocks_of(tensor, weight, linear_formats)
            if blocks is None and (only is not None or weight.shape[1] % BLOCK):
                return None
            linears[name] = blocks if blocks is not None else requantize(weight)
            held[tensor] = linears[name].kind
    embed = model.get_input_embeddings().weight.detach().float().cpu().numpy()
    embedding = blocks_of("token_embd.weight", embed, FORMATS)
    held["token_embd.weight"] = embedding.kind if embedding is not None else "fp32"
    head = model.get_output_embeddings().weight.detach().float().cpu().numpy()
    head_tensor = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    no_minimum = {k for k in FORMATS if FORMATS[k][2] not in (_q4_1, _q4_k)}
    lm_head = blocks_of(head_tensor, head, no_minimum)
    if lm_head is None and head.shape[1] % BLOCK == 0:
        lm_head = requantize(head)
    if head_tensor == "output.weight":
        held[head_tensor] = lm_head.kind if lm_head is not None else "fp32"
    order = {t.name: i for i, t in enumerate(reader.tensors)}
    return GgufWeights(linears, embedding, lm_head, tuple(sorted(held.items(), key=lambda kv: order.get(kv[0], 0))))


def read_gguf_embedding(gguf_path: str | Path, model) -> Blocks | None:
    """The token embedding's blocks where they decode bit for bit to ``model``'s table, else None."""
    from gguf import GGUFReader

    t = next((t for t in GGUFReader(str(gguf_path)).tensors if t.name == "token_embd.weight"), None)
    if t is None:
        return None
    embed = model.get_input_embeddings().weight.detach().float().cpu().numpy()
    return _exact(parse(t.data, t.tensor_type.name, *embed.shape), embed)


def read_q4_1_linears(gguf_path: str | Path, model) -> dict[str, Blocks] | None:
    """Every decoder-layer linear of ``model`` as its GGUF Q4_1 blocks, keyed by transformers name, or
    None (the caller writes fp32 weights instead) unless all of them are Q4_1 and decode bit for bit."""
    weights = read_gguf_weights(gguf_path, model, only=frozenset({"Q4_1"}))
    return None if weights is None else weights.linears
