"""The ``ort`` graph target: the base step written op by op for ONNX Runtime's fused kernels.

The ``trt`` target (``export.py``) is a dynamo trace in standard ops: rotary, GQA and the cache write
come out as ~43 small nodes per layer, and ONNX Runtime's CPU provider fuses only the norms and SiLU.
This module writes the same step directly from the model's weights with ``onnx.helper``, one fused
node per job, and keeps the exact contract of the traced graph (same inputs, outputs, dtypes and
dynamic dimensions), so the runtime runs either graph unchanged.

It uses ONNX Runtime's ``com.microsoft`` kernels, chosen by measurement against a standard-op
(opset 24 ``Attention``/``TensorScatter``) form and the traced graph (docs/benchmarks.md, "Graph forms"):
``SkipSimplifiedLayerNormalization`` (residual add + RMSNorm) and ``GroupQueryAttention``. GQA takes
the packed q|k|v projection, applies rotary at ``position_ids`` itself, writes the new K/V rows into
the cache buffer in place (the runtime binds ``present_*`` to ``past_*``, which GQA detects as a
shared buffer) and attends only over the valid ``past + T`` slots, not the whole capacity bucket.

Tree attention holds exactly. A node at row j sits at position ``past + depth_j`` (rotary
reads ``position_ids``) and sees the past plus its ancestors through ``attention_mask``, sliced to the
``past + T`` valid slots. GQA additionally applies a causal mask by row; that hides nothing a tree
node needs, because the runtime orders tree nodes parents first (every ancestor has a smaller row).

Row-exact 1-row steps: every node computes a row the same whatever the step's row count
(measured bitwise, int8 activations included), except GQA, whose 1-row path sums in another order.
So GQA always runs at least two rows: a 1-row step pads its q|k|v, positions and mask with a copy of
its row, which writes a dummy K/V to the next cache slot (overwritten by the next step) and is
dropped right after the attention. A 1-row step then computes bitwise row 0 of a multi-row step, at
the cost of a 1-row step; the model metadata records it (``GraphEntry.attention_rows``), and the
runtime then needs no dummy rows of its own (see ``Decoder``).

The exact-tree form (``attention`` "gathered", the bundle's ``TREE_TARGET`` graph, ``ort_gathered.py``):
the same graph without the padding, its attention in standard ops over each row's keys in plain-step
order. It takes rows of several sequences in one step, which batching runs: row b's slots are
``write_indices`` shifted by ``position_ids[b, 0] - position_ids[0, 0]`` (``contract.WRITE_INDICES``), so
each sequence of a batch keeps its tokens at the cache columns they hold alone (``GraphEntry.rows_apart``).

The graph requires what the runtime always sends: ``write_indices`` is ``past .. past+T-1``
(contiguous), so ``past + T = write_indices[-1] + 1``; the parity tests in ``validate`` and
``tests/exporter/test_ort_graph.py`` check every output against the torch reference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from specdeploy.runtime import contract

MS = "com.microsoft"
ATTENTION_ROWS = 2  # the fewest rows the graph's attention runs (a 1-row step is padded inside)
ATTENTION_FUSED, ATTENTION_GATHERED = "fused", "gathered"  # build_ort_graph's forms
ATTENTION_ROWS_KEY = "specdeploy.attention_rows"  # model metadata: what GraphEntry.attention_rows records
ROWS_APART_KEY = "specdeploy.rows_apart"  # model metadata: what GraphEntry.rows_apart records
WEIGHT_BLOCKS_KEY = "specdeploy.weight_blocks"  # model metadata (JSON): what GraphEntry.weight_blocks records


_ALIGN = 4096  # external tensors start on page boundaries (ONNX Runtime can then map them)


class _Builder:
    """Accumulates nodes and initializers, with fresh names.

    With ``data`` (an open binary file), every initializer over 1 KiB is streamed straight into it
    and referenced as external data, so the graph never holds a second copy of the weights in
    memory (building SmolLM2 this way peaks near the model's own size instead of three times it).
    """

    def __init__(self, data=None, location: str = ""):
        self.nodes: list = []
        self.inits: list = []
        self._n = 0
        self._data, self._location = data, location

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def init(self, name: str, array: np.ndarray) -> str:
        from onnx import TensorProto, helper, numpy_helper

        array = np.asarray(array)
        if self._data is None or array.nbytes <= 1024:
            self.inits.append(numpy_helper.from_array(np.array(array, order="C"), name))  # keeps 0-d scalars 0-d
            return name
        pad = (-self._data.tell()) % _ALIGN
        self._data.write(b"\0" * pad)
        offset = self._data.tell()
        self._data.write(np.ascontiguousarray(array).tobytes())
        tensor = TensorProto(name=name, dims=array.shape,
                             data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self._location), ("offset", str(offset)), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.inits.append(tensor)
        return name

    def const(self, values, dtype=np.int64) -> str:
        return self.init(self.name("const"), np.asarray(values, dtype=dtype))

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", outputs: list[str] | None = None,
           **attrs) -> list[str]:
        from onnx import helper

        outs = outputs or [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type), domain=domain, **attrs))
        return outs

    def one(self, op_type: str, inputs: list[str], domain: str = "", **attrs) -> str:
        return self.op(op_type, inputs, 1, domain, **attrs)[0]


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _nbits_inputs(g: _Builder, x: str, name: str, blocks) -> list[str]:
    """MatMulNBits' inputs for ``blocks``; no zero-point input where the zero point is the kernel's own
    default (2**(bits-1): the symmetric path, which runs faster than explicit zero points)."""
    packed, scales, zero_points = blocks.matmulnbits_inputs()
    inputs = [x, g.init(name + f".q{blocks.bits}", packed), g.init(name + ".scales", scales)]
    if blocks.zero != 1 << (blocks.bits - 1):
        inputs.append(g.init(name + ".zero_points", zero_points))
    return inputs


def block_linear(g: _Builder, x: str, name: str, blocks, accuracy_level: int = 0) -> str:
    """``x [R, K] @ W.T`` for ``W = scale * (q - zero) + minimum`` held as the GGUF's own blocks
    (:class:`gguf_blocks.Blocks`), on the rows of a flat ``[R, K]`` input: ``MatMulNBits`` gives the
    ``scale * (q - zero)`` part, and for formats with a block minimum (Q4_1, Q4_K) a ``Gemm`` of x's block
    sums with the minima adds that part onto it: one node for the product and the sum, where a ``MatMul``
    and an ``Add`` took 2.67 against 1.94 ms for a step's 120 terms on an AVX2 EPYC (decode steps 6%
    faster there). ``accuracy_level`` 4 quantizes x to int8 inside the kernel (the ``q4_1`` and ``gguf``
    precisions, llama.cpp's arithmetic); 0 multiplies in fp32."""
    n, k = blocks.shape
    y = g.one("MatMulNBits", _nbits_inputs(g, x, name, blocks), MS,
              K=k, N=n, bits=blocks.bits, block_size=blocks.block, accuracy_level=accuracy_level)
    if blocks.minimum is None:
        return y
    sums = g.one("ReduceSum", [g.one("Reshape", [x, g.const([-1, k // blocks.block, blocks.block])]),
                               g.const([-1])], keepdims=0)  # [R, K/block]: the sum of x over each block
    return g.one("Gemm", [sums, g.init(name + ".block_min", blocks.minimum.T), y])


def blocks_linear(g: _Builder, x: str, name: str, parts: list, accuracy_level: int = 0) -> str:
    """``x @ [W_1; W_2; ...].T`` for weights held as blocks: one node (stacked) where the parts share a
    layout, else one per run of equal layouts, concatenated (Qwen's v_proj is Q8_0 beside Q5_0 q/k)."""
    from itertools import groupby

    from specdeploy.exporter.export.gguf_blocks import Blocks

    runs = [list(run) for _, run in groupby(parts, key=lambda b: b.layout)]
    outs = [block_linear(g, x, name if len(runs) == 1 else f"{name}.{i}", Blocks.concat(run), accuracy_level)
            for i, run in enumerate(runs)]
    return outs[0] if len(outs) == 1 else g.one("Concat", outs, axis=-1)


VALUE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q6_K": 6}  # significant bits of q; others 8


def _exact_fp16(a: np.ndarray) -> np.ndarray:
    """``a`` as fp16 where that loses nothing (GGUF scales are fp16), else as it is."""
    half = a.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), a) else a


def embedding_rows(g: _Builder, ids: str, blocks, name: str = "embed") -> str:
    """The embedding rows of flat ``ids [R]`` decoded from the GGUF's blocks: ``[R, H]`` fp32, the same
    values as the dequantized table. The table is stored as packed integers (a nibble plane, then one
    plane per further bit; a byte plane for 8-bit formats) plus the block scales, and only the R rows a
    step reads are unpacked: a few hundred operations instead of a vocabulary x hidden fp32 table."""
    from onnx import TensorProto

    h = blocks.shape[1]
    bits = VALUE_BITS.get(blocks.kind, 8)
    q = blocks.q
    if bits == 8:
        values = g.one("Cast", [g.one("Gather", [g.init(name + ".q8", q), ids], axis=0)], to=TensorProto.FLOAT)
    else:
        nib = q & 0x0F
        packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)  # [V, H/2]
        rows = g.one("Gather", [g.init(name + ".q4", packed), ids], axis=0)
        pair = [g.one("Unsqueeze", [g.one("BitwiseAnd", [rows, g.const(15, np.uint8)]), g.const([-1])]),
                g.one("Unsqueeze", [g.one("BitShift", [rows, g.const(4, np.uint8)], direction="RIGHT"),
                                    g.const([-1])])]
        values = g.one("Cast", [g.one("Reshape", [g.one("Concat", pair, axis=-1), g.const([-1, h])])],
                       to=TensorProto.FLOAT)
        shifts = g.const(np.arange(8), np.uint8) if bits > 4 else None
        for j in range(4, bits):  # one plane per further bit, eight values a byte
            plane = np.packbits(((q >> j) & 1).astype(np.uint8), axis=1, bitorder="little")  # [V, H/8]
            rows = g.one("Gather", [g.init(f"{name}.bit{j}", plane), ids], axis=0)
            spread = g.one("BitShift", [g.one("Unsqueeze", [rows, g.const([-1])]), shifts], direction="RIGHT")
            bit = g.one("Cast", [g.one("Reshape", [g.one("BitwiseAnd", [spread, g.const(1, np.uint8)]),
                                                   g.const([-1, h])])], to=TensorProto.FLOAT)
            values = g.one("Add", [values, g.one("Mul", [bit, g.const(float(1 << j), np.float32)])])
    per = blocks.block
    values = g.one("Reshape", [values, g.const([-1, h // per, per])])
    if blocks.zero:
        values = g.one("Sub", [values, g.const(float(blocks.zero), np.float32)])

    def gathered(table: np.ndarray, what: str) -> str:
        stored = _exact_fp16(table)
        rows = g.one("Gather", [g.init(f"{name}.{what}", stored), ids], axis=0)
        if stored.dtype != np.float32:
            rows = g.one("Cast", [rows], to=TensorProto.FLOAT)
        return g.one("Unsqueeze", [rows, g.const([-1])])

    values = g.one("Mul", [gathered(blocks.scale, "scales"), values])
    if blocks.minimum is not None:
        values = g.one("Add", [values, gathered(blocks.minimum, "block_min")])
    return g.one("Reshape", [values, g.const([-1, h])])


def rotary_tables(step, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches ``[max_positions, D/2]`` from the model's own rotary module (scaling included)."""
    import torch

    pos = torch.arange(max_positions).unsqueeze(0)
    dummy = torch.zeros(1, 1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = step.rotary_emb(dummy, pos)  # [1, P, D], halves duplicated (rotate-half form)
    half = step.head_dim // 2
    return _np(cos[0, :, :half]), _np(sin[0, :, :half])


def build_ort_graph(step, max_positions: int, data=None, location: str = "", blocks: dict | None = None,
                    block_accuracy: int = 0, pad_attention: bool = True, embedding=None, lm_head=None,
                    attention: str = ATTENTION_FUSED):
    """An ``onnx.ModelProto`` of the base step of ``step`` (a :class:`BaseStep`).

    With ``data`` (a binary file opened for writing), the weights go there as external data named
    ``location``; without it they are held in the proto (fine for small models). ``blocks`` (the
    ``linears`` of :func:`gguf_blocks.read_gguf_weights`) keeps the decoder-layer weights as the source
    GGUF's own blocks instead of fp32; ``embedding`` and ``lm_head`` (:class:`gguf_blocks.Blocks`) do the
    same for the token table (rows decoded in the graph) and the logits MatMul (at ``block_accuracy``).
    ``attention`` "gathered" writes the exact-tree graph (each row's keys in plain-step order, rows of several
    sequences at their own columns, no padding; see the module's notes). ``pad_attention`` False leaves out
    the padding of 1-row steps' attention (the control in the tests). Blocks at accuracy level 0 are never padded:
    ``MatMulNBits`` with fp32 activations has its own 1-row path, so padding the attention would cost
    time and buy no exactness (that graph serves plain steps of non-row-exact decoding only).
    """
    from onnx import TensorProto, helper

    g = _Builder(data, location)
    hq, hkv, d, n_layers = step.num_heads, step.num_kv_heads, step.head_dim, step.num_layers
    hidden = step.embed_tokens.weight.shape[1]
    vocab = step.embed_tokens.weight.shape[0]

    embed = None if embedding is not None else g.init("embed_tokens", _np(step.embed_tokens.weight))
    lm_head_t = None if lm_head is not None else g.init("lm_head_t", _np(step.lm_head.weight).T)  # [H, V]
    cos, sin = rotary_tables(step, max_positions)
    cos_name, sin_name = g.init("rotary_cos", cos), g.init("rotary_sin", sin)

    write, positions = contract.WRITE_INDICES, contract.POSITION_IDS
    gathered = attention == ATTENTION_GATHERED
    pad_attention = pad_attention and attention == ATTENTION_FUSED and (blocks is None or block_accuracy == 4)
    if pad_attention:
        # GQA runs >= ATTENTION_ROWS rows: a 1-row step gets a dummy copy of its row inside the graph
        # (``pad`` = [0, 0]), written to the next cache slot and dropped after the attention. GQA's
        # 1-row path sums in another order than its multi-row path (row 0 of a 1-row and a 2-row step
        # differ by ~1e-7, which int8 activations turn into flipped tokens), while every other node
        # here computes a row the same whatever the row count. So a 1-row step computes bitwise what
        # row 0 of a multi-row step does, at the cost of a 1-row step.
        t = g.one("Gather", [g.one("Shape", [contract.INPUT_IDS]), g.const(1)], axis=0)
        rows = g.one("Range", [g.const(0), g.one("Max", [t, g.const(ATTENTION_ROWS)]), g.const(1)])
        pad = g.one("Min", [rows, g.one("Sub", [t, g.const(1)])])  # [max(T, 2)]: 0..T-1, or 0, 0
        t_1d = g.one("Unsqueeze", [t, g.const([0])])
        write = g.one("Add", [g.one("Gather", [write, pad], axis=0), g.one("Sub", [rows, pad])])
        positions = g.one("Gather", [positions, pad], axis=1)
    # Shared per-step scalars: total = past + T = write_indices[-1] + 1 (T after padding).
    last = g.one("Gather", [write, g.const(-1)], axis=0)  # int64 scalar
    if gathered:  # row b's last slot: write_indices[-1] + position_ids[b, 0] - position_ids[0, 0]
        first = g.one("Reshape", [g.one("Slice", [positions, g.const([0]), g.const([1]), g.const([1])]),
                                  g.const([-1])])  # [B]
        last = g.one("Add", [g.one("Sub", [first, g.one("Gather", [first, g.const(0)], axis=0)]), last])  # [B]
        total = g.one("Add", [g.one("ReduceMax", [last, g.const([0])], keepdims=0), g.const(1)])
    else:
        total = g.one("Add", [last, g.const(1)])
    total_1d = g.one("Unsqueeze", [total, g.const([0])])  # [1]
    mask = g.one("Slice", [contract.ATTENTION_MASK, g.const([0]), total_1d, g.const([3])])  # [B, 1, T, past+T]
    if pad_attention:
        mask = g.one("Gather", [mask, pad], axis=2)
    order = None
    if gathered:  # each row's slots in plain-step order, shared by every layer (ort_gathered.py)
        from specdeploy.exporter.export.ort_gathered import gather_order

        capacity = g.one("Gather", [g.one("Shape", [contract.past_names(n_layers)[0]]), g.const(2)], axis=0)
        order = gather_order(g, mask, write, positions, total, capacity, (hq, hkv, d))
    total_i32 = g.one("Cast", [total], to=TensorProto.INT32)
    batch = g.one("Gather", [g.one("Shape", [contract.INPUT_IDS]), g.const(0)], axis=0)
    batch_1d = g.one("Unsqueeze", [batch, g.const([0])])
    seqlens = g.one("Expand", [g.one("Sub", [total_i32, g.const(1, np.int32)]), batch_1d])  # [B] int32

    def linear(x: str, name: str, weight, parts: list[str]) -> str:
        """x @ W.T, from fp32 weights or from the GGUF blocks of the transformers modules ``parts``."""
        if blocks is None:
            return g.one("MatMul", [x, g.init(name, _np(weight).T)])
        return blocks_linear(g, x, name, [blocks[p] for p in parts], block_accuracy)

    # With GGUF blocks the layers run on flat rows [B*T, H], so that each linear's block-minimum term is
    # one Gemm (2-D only) added onto its MatMulNBits; attention and the outputs take [B, T, .] views.
    flat = blocks is not None
    ids = g.one("Reshape", [contract.INPUT_IDS, g.const([-1])]) if flat or embed is None else contract.INPUT_IDS
    bt = g.one("Shape", [contract.INPUT_IDS]) if flat or embed is None else None  # [B, T]
    if embed is not None:
        x = g.one("Gather", [embed, ids], axis=0)  # [B, T, H], or [B*T, H] flat
    else:
        x = embedding_rows(g, ids, embedding)  # [B*T, H]
        if not flat:
            x = g.one("Reshape", [x, g.one("Concat", [bt, g.const([hidden])], axis=0)])
    shapes: dict[int, str] = {}
    ctx_rows = g.const([-1, hq * d]) if flat else None  # the attention output back to flat rows

    def batched(v: str, width: int, out: str | None = None) -> str:
        """A flat [B*T, width] value as [B, T, width] (as it is, when not flat)."""
        if not flat:
            return v if out is None else g.op("Identity", [v], outputs=[out])[0]
        if width not in shapes:
            shapes[width] = g.one("Concat", [bt, g.const([width])], axis=0)
        return g.op("Reshape", [v, shapes[width]], outputs=[out] if out else None)[0]
    residual_in = None  # the sublayer output still to be added to x
    past_names, present_names = contract.past_names(n_layers), contract.present_names(n_layers)

    def norm(weight: str, eps: float) -> str:
        """RMSNorm of x + residual_in; updates x to the sum (one fused kernel)."""
        nonlocal x, residual_in
        if residual_in is None:
            return g.one("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=eps, stash_type=1)
        out, _, _, summed = g.op("SkipSimplifiedLayerNormalization", [x, residual_in, weight], 4, MS, epsilon=eps)
        x, residual_in = summed, None
        return out

    taps: list[str] = []  # residual outputs of step.feature_layers (the first norm of the next block sums them)
    for i, blk in enumerate(step.blocks):
        p = f"layers.{i}."
        h = norm(g.init(p + "input_norm", _np(blk.input_norm_weight)), blk.input_norm_eps)
        if i - 1 in step.feature_layers:
            taps.append(x)
        m = f"model.layers.{i}."
        qkv = linear(h, p + "qkv_t", blk.qkv.weight, [m + "self_attn.q_proj", m + "self_attn.k_proj",
                                                      m + "self_attn.v_proj"])
        if blk.qkv.bias is not None:
            qkv = g.one("Add", [qkv, g.init(p + "qkv_bias", _np(blk.qkv.bias))])
        past_k, past_v = past_names[2 * i], past_names[2 * i + 1]
        pres_k, pres_v = present_names[2 * i], present_names[2 * i + 1]
        # packed q|k|v in; rotary (at position_ids) and the in-place cache write inside
        qkv = batched(qkv, (hq + 2 * hkv) * d)
        if pad_attention:
            qkv = g.one("Gather", [qkv, pad], axis=1)
        if order is not None:
            from specdeploy.exporter.export.ort_gathered import gathered_attention

            ctx = gathered_attention(g, qkv, positions, order, past_k, past_v, pres_k, pres_v, cos_name, sin_name,
                                     (hq, hkv, d), float(step.scale))
        else:
            ctx = g.op("GroupQueryAttention", [qkv, "", "", past_k, past_v, seqlens, total_i32, cos_name, sin_name,
                                               positions, mask],
                       outputs=[g.name("attn"), pres_k, pres_v], domain=MS, num_heads=hq, kv_num_heads=hkv,
                       scale=float(step.scale), do_rotary=1, rotary_interleaved=0)[0]
        if pad_attention:
            ctx = g.one("Slice", [ctx, g.const([0]), t_1d, g.const([1])])  # the step's own rows
        if flat:
            ctx = g.one("Reshape", [ctx, ctx_rows])
        residual_in = linear(ctx, p + "o_proj_t", blk.o_proj.weight, [m + "self_attn.o_proj"])
        h = norm(g.init(p + "post_norm", _np(blk.post_norm_weight)), blk.post_norm_eps)
        gate_up = linear(h, p + "gate_up_t", blk.gate_up.weight, [m + "mlp.gate_proj", m + "mlp.up_proj"])
        gate, up = g.op("Split", [gate_up], 2, axis=-1, num_outputs=2)
        act = g.one("Mul", [gate, g.one("Sigmoid", [gate])])  # SiLU; ORT fuses it
        residual_in = linear(g.one("Mul", [act, up]), p + "down_t", blk.down_proj.weight, [m + "mlp.down_proj"])

    final = batched(norm(g.init("final_norm", _np(step.norm_weight)), step.norm_eps), hidden,
                    contract.HIDDEN_STATES)
    if taps and flat:
        batched(g.one("Concat", taps, axis=-1), len(taps) * hidden, contract.LAYER_STATES)
    elif taps:  # already [B, T, L*H]: straight into the output, no extra node
        g.op("Concat", taps, outputs=[contract.LAYER_STATES], axis=-1)
    kept = g.one("Gather", [final, contract.LOGITS_INDEX], axis=1)  # [B, K, H]
    if lm_head is None:
        g.op("MatMul", [kept, lm_head_t], outputs=[contract.LOGITS])
    else:  # MatMulNBits takes [B, K, H] as it is; the lm_head formats have no block minimum
        assert lm_head.minimum is None
        g.op("MatMulNBits", _nbits_inputs(g, kept, "lm_head", lm_head), outputs=[contract.LOGITS], domain=MS,
             K=hidden, N=vocab, bits=lm_head.bits, block_size=lm_head.block, accuracy_level=block_accuracy)

    dtypes = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64}
    kv = list(contract.kv_dims(hkv, d))
    inputs = [helper.make_tensor_value_info(n, dtypes[t], list(dims)) for n, t, dims in contract.STEP_INPUTS]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv) for n in past_names]
    outputs = [helper.make_tensor_value_info(n, dtypes[t], list(dims))
               for n, t, dims in contract.step_outputs(vocab, hidden, len(taps))]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv) for n in present_names]
    graph = helper.make_graph(g.nodes, "specdeploy_base_ort", inputs, outputs, initializer=g.inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="specdeploy")
    model.ir_version = 10
    props = {ATTENTION_ROWS_KEY: str(ATTENTION_ROWS)} if pad_attention else {}
    if gathered:  # each row written at its own sequence's columns (ort_gathered.gather_order)
        props[ROWS_APART_KEY] = "1"
    if taps:
        props[contract.FEATURE_LAYERS_KEY] = ",".join(str(i) for i in step.feature_layers)
    if props:
        helper.set_model_props(model, props)
    return model


def save_graph(model, path: Path) -> None:
    """Save with all weights in ``<name>.data`` next to the graph (replacing an existing file)."""
    import onnx

    path = Path(path)
    data = path.with_name(path.name + ".data")
    if data.exists():  # onnx appends to an existing external-data file
        data.unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    data.chmod(0o644)  # the external-data writer leaves it owner-only; bundles are shared read-only


def export_ort_graph(step, path: Path, max_positions: int, progress: Callable[[str], None] | None = None,
                     blocks: dict | None = None, block_accuracy: int = 0, embedding=None, lm_head=None,
                     props: dict[str, str] | None = None, attention: str = ATTENTION_FUSED) -> None:
    """Build the ``ort``-target base graph of ``step`` at ``path``, weights streamed to ``<path>.data``."""
    import onnx

    path = Path(path)
    data = path.with_name(path.name + ".data")
    with open(data, "wb") as f:
        model = build_ort_graph(step, max_positions, data=f, location=data.name, blocks=blocks,
                                block_accuracy=block_accuracy, embedding=embedding, lm_head=lm_head,
                                attention=attention)
    if props:
        from onnx import helper

        helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **props})
    if progress:
        progress(f"      {len(model.graph.node)} nodes, weights {data.stat().st_size / 2**20:.0f} MiB "
                 f"in {data.name}")
    onnx.save_model(model, str(path))
