"""A tiny GGUF written with the ``gguf`` package: every block format the ``gguf`` precision holds, in one file.

The tensors carry random weights in the formats of :data:`FORMATS` (gguf quantizes the legacy formats
itself; the K-quants, which gguf-py cannot quantize, get random codes under small fp16 scales) plus one
fp16 tensor that no block can hold. The tokenizer is SmolLM2's, copied from the embedded GGUF, so
transformers loads the file like any other.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K-quants need K in whole 256-value super-blocks
# (tensor, format): every format twice over, Qwen's mix of Q5_0 beside a Q8_0 v_proj, and an F16 tensor.
FORMATS = {
    "token_embd": "Q5_0", "output": "Q6_K",
    "blk.0.attn_q": "Q4_0", "blk.0.attn_k": "Q4_1", "blk.0.attn_v": "Q8_0", "blk.0.attn_output": "Q5_0",
    "blk.0.ffn_gate": "Q4_K", "blk.0.ffn_up": "Q6_K", "blk.0.ffn_down": "Q4_K",
    "blk.1.attn_q": "Q5_0", "blk.1.attn_k": "Q5_0", "blk.1.attn_v": "Q8_0", "blk.1.attn_output": "Q8_0",
    "blk.1.ffn_gate": "F16", "blk.1.ffn_up": "Q5_0", "blk.1.ffn_down": "Q6_K",
}
_K_SCALES = {"Q4_K": ((0, 2), 2e-4), "Q6_K": ((208,), 2e-5)}  # fp16 field offsets, typical scale


def _tensor(kind: str, n: int, k: int, rng) -> tuple[np.ndarray, object]:
    """(data, raw dtype) of an [n, k] weight in GGUF format ``kind``."""
    from gguf import GGMLQuantizationType, quants

    if kind == "F16":
        return rng.normal(0, 0.08, (n, k)).astype(np.float16), None
    qtype = GGMLQuantizationType[kind]
    if kind not in _K_SCALES:
        return quants.quantize(rng.normal(0, 0.08, (n, k)).astype(np.float32), qtype), qtype
    values, size = 256, {"Q4_K": 144, "Q6_K": 210}[kind]
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    offsets, typical = _K_SCALES[kind]
    for offset in offsets:
        scale = rng.uniform(0.5 * typical, 1.5 * typical, (n, k // values)).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(n, k // values, 2)
    return raw.reshape(n, -1), qtype


def write_tiny_gguf(dest: Path, tokenizer_gguf: Path, arch: str = "qwen2", seed: int = 0) -> Path:
    """A 2-layer ``arch`` GGUF at ``dest`` ("qwen2": q/k/v biases, untied output; "llama": neither)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    rng = np.random.default_rng(seed)
    source = GGUFReader(str(tokenizer_gguf))
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    w = GGUFWriter(str(dest), arch)
    w.add_name(f"tiny {arch} in every block format")
    w.add_block_count(LAYERS)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1e6 if arch == "qwen2" else 1e4)
    w.add_layer_norm_rms_eps(1e-6)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub)
    head = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head, HIDDEN), "attn_v": (KV_HEADS * head, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}

    def add(name: str, kind: str, n: int, k: int) -> None:
        data, qtype = _tensor(kind, n, k, rng)
        w.add_tensor(f"{name}.weight", data, raw_dtype=qtype)

    add("token_embd", FORMATS["token_embd"], vocab, HIDDEN)
    if arch == "qwen2":
        add("output", FORMATS["output"], vocab, HIDDEN)
    w.add_tensor("output_norm.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
    for i in range(LAYERS):
        for part, (n, k) in shapes.items():
            add(f"blk.{i}.{part}", FORMATS[f"blk.{i}.{part}"], n, k)
            if arch == "qwen2" and part in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{part}.bias", rng.normal(0, 0.1, n).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest
