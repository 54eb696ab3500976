"""The base model's decoder step, written for export: tree attention over an in-place static KV cache.

One graph serves prefill, the 1-token autoregressive step and the tree verification step:

    input_ids      [B, T]        int64
    position_ids   [B, T]        int64   a tree node sits at past length + its depth
    attention_mask [B, 1, T, C]  float   additive: 0 where visible, -inf-ish where hidden
    write_indices  [T]           int64   cache slots the T new K/V rows are written to
    logits_index   [K]           int64   rows of T whose logits are wanted (prefill: the last one)
    past_key_i     [B, Hkv, C, D] float  the preallocated cache of capacity C (one per layer)
    past_value_i   [B, Hkv, C, D]
  ->
    logits         [B, K, V]
    hidden_states  [B, T, H]     the lm_head input, which the drafts need
    layer_states   [B, T, L*H]   only with ``feature_layers``: the tapped layers' residual outputs
    present_key_i  [B, Hkv, C, D] the cache with the T new rows written (bind it to past_key_i)
    present_value_i

The cache write is a ScatterND; ONNX Runtime lets ``present_*`` alias ``past_*``, so no per-step
copy of the cache happens outside the graph. The module holds no state: everything comes in and
goes out, which is what export and CUDA-graph capture need.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm written as x / sqrt(mean(x^2) + eps) * w: ONNX Runtime fuses this form (not the
    rsqrt form transformers uses) into one SimplifiedLayerNormalization kernel. In fp16/bf16 the square
    and the mean run in fp32, as transformers does (an fp16 square overflows past 256)."""
    if x.dtype != torch.float32:
        x32 = x.float()
        return (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def check_feature_layers(feature_layers, num_layers: int) -> tuple[int, ...]:
    """Tapped layers as a tuple: increasing, within ``0..num_layers-2`` (the last layer's state is the hidden
    state itself), else ValueError."""
    taps = tuple(int(i) for i in feature_layers)
    if any(not 0 <= i < num_layers - 1 for i in taps) or list(taps) != sorted(set(taps)):
        raise ValueError(f"feature layers must increase within 0..{num_layers - 2}, got {taps}")
    return taps


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6))


def _fused_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of ``linears``' outputs (fewer, larger GEMMs)."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = linears[0].bias is not None
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
    out.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        out.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
    return out


class FusedBlock(nn.Module):
    """One decoder layer's weights, with q/k/v and gate/up projections concatenated."""

    def __init__(self, qkv: nn.Linear, o_proj: nn.Linear, gate_up: nn.Linear, down_proj: nn.Linear,
                 norms: tuple[torch.Tensor, float, torch.Tensor, float], act: nn.Module):
        super().__init__()
        self.input_norm_weight, self.input_norm_eps, self.post_norm_weight, self.post_norm_eps = norms
        self.qkv, self.o_proj, self.gate_up, self.down_proj, self.act = qkv, o_proj, gate_up, down_proj, act

    @classmethod
    def from_hf(cls, layer: nn.Module) -> FusedBlock:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, _eps(layer.input_layernorm),
                 layer.post_attention_layernorm.weight, _eps(layer.post_attention_layernorm))
        return cls(_fused_linear([attn.q_proj, attn.k_proj, attn.v_proj]), attn.o_proj,
                   _fused_linear([mlp.gate_proj, mlp.up_proj]), mlp.down_proj, norms, mlp.act_fn)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class BaseStep(nn.Module):
    """Stateless decoder step over a Llama-family causal LM (weights are shared, not copied).

    ``BaseStep(model)`` wraps a Hugging Face model (what export traces); ``BaseStep.from_parts`` builds
    one from plain tensors, with no transformers (``graphs/native_step.py``). Three options serve the
    torch backend and are off for export: ``inplace_kv`` writes the new K/V rows into the ``past``
    buffers themselves (no out-of-place copy of the cache per layer), ``sdpa`` runs attention with
    ``scaled_dot_product_attention`` (fused kernels on a GPU) instead of explicit matmuls and softmax, and
    ``gathered`` runs :func:`gathered_attention` (each row over its keys in plain-step order: exact trees).
    """

    def __init__(self, model: nn.Module, feature_layers: tuple[int, ...] = ()):
        super().__init__()
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._set_parts(model.model.embed_tokens, [FusedBlock.from_hf(layer) for layer in model.model.layers],
                        (model.model.norm.weight, _eps(model.model.norm)), model.lm_head, model.model.rotary_emb,
                        (cfg.num_attention_heads, cfg.num_key_value_heads, head_dim), feature_layers)

    @classmethod
    def from_parts(cls, embed: nn.Embedding, blocks: list[FusedBlock], norm: tuple[torch.Tensor, float],
                   lm_head: nn.Linear, rotary: nn.Module, heads: tuple[int, int, int],
                   feature_layers: tuple[int, ...] = ()) -> BaseStep:
        """A step from its parts: ``rotary(x, position_ids)`` gives (cos, sin) ``[B, T, D]`` in x's dtype;
        ``heads`` is (query heads, KV heads, head dim)."""
        step = cls.__new__(cls)
        nn.Module.__init__(step)
        step._set_parts(embed, blocks, norm, lm_head, rotary, heads, feature_layers)
        return step

    def _set_parts(self, embed, blocks, norm, lm_head, rotary, heads, feature_layers) -> None:
        self.num_layers = len(blocks)
        self.feature_layers = check_feature_layers(feature_layers, self.num_layers)
        self.num_heads, self.num_kv_heads, self.head_dim = heads
        self.embed_tokens = embed
        self.blocks = nn.ModuleList(blocks)
        self.norm_weight, self.norm_eps = norm
        self.lm_head = lm_head
        self.rotary_emb = rotary
        self.scale = self.head_dim**-0.5
        self.inplace_kv = False
        self.sdpa = False
        self.gathered = False

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        write_indices: torch.Tensor,
        logits_index: torch.Tensor,
        past: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        bsz, t = input_ids.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        group = hq // hkv
        x = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary_emb(x, position_ids)  # [B, T, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        presents: list[torch.Tensor] = []
        taps: list[torch.Tensor] = []
        widx = write_indices.view(1, 1, t, 1).expand(bsz, hkv, t, d)  # [B, Hkv, T, D]
        for i, blk in enumerate(self.blocks):
            h = rms_norm(x, blk.input_norm_weight, blk.input_norm_eps)
            q, k, v = blk.qkv(h).split([hq * d, hkv * d, hkv * d], dim=-1)  # one GEMM for q, k and v
            q = q.view(bsz, t, hq, d).transpose(1, 2)  # [B, Hq, T, D]
            k = k.view(bsz, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
            v = v.view(bsz, t, hkv, d).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            # In-place cache write: rows write_indices of the capacity axis get the new K/V. A
            # ScatterElements on axis 2 works on the [B, Hkv, C, D] layout directly; index_copy would
            # export as ScatterND wrapped in two full-cache Transposes, copying the cache every step.
            if self.inplace_kv:  # the buffers themselves (torch backend): no copy of the cache
                k_all, v_all = past[2 * i].scatter_(2, widx, k), past[2 * i + 1].scatter_(2, widx, v)
            else:  # out of place: what exports to a ScatterND whose output ONNX Runtime aliases to past
                k_all, v_all = past[2 * i].scatter(2, widx, k), past[2 * i + 1].scatter(2, widx, v)
            presents += [k_all, v_all]
            if self.gathered:
                ctx = gathered_attention(q, k_all, v_all, attention_mask, self.scale)  # [B, T, Hq*D]
            elif self.sdpa:
                ctx = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attention_mask, scale=self.scale,
                                                     enable_gqa=group > 1)  # [B, Hq, T, D]
            else:
                # GQA without materialising repeated K/V: fold the query group into the row axis.
                qg = q.reshape(bsz, hkv, group * t, d)  # [B, Hkv, G*T, D]
                scores = torch.matmul(qg, k_all.transpose(2, 3)) * self.scale  # [B, Hkv, G*T, C]
                scores = scores.view(bsz, hq, t, -1) + attention_mask  # [B, Hq, T, C]
                probs = torch.softmax(scores, dim=-1).view(bsz, hkv, group * t, -1)
                ctx = torch.matmul(probs, v_all).view(bsz, hq, t, d)  # [B, Hq, T, D]
            if not self.gathered:
                ctx = ctx.transpose(1, 2).reshape(bsz, t, hq * d)
            x = x + blk.o_proj(ctx)
            gate, up = blk.gate_up(rms_norm(x, blk.post_norm_weight, blk.post_norm_eps)).chunk(2, dim=-1)
            x = x + blk.down_proj(blk.act(gate) * up)
            if i in self.feature_layers:
                taps.append(x)
        hidden = rms_norm(x, self.norm_weight, self.norm_eps)  # [B, T, H]
        logits = self.lm_head(hidden.index_select(1, logits_index))  # [B, K, V]
        if taps:
            return (logits, hidden, torch.cat(taps, dim=-1), *presents)
        return (logits, hidden, *presents)


def gathered_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Attention in which every row reads its slots in the order a plain step reads them: its visible slots
    ascending (the past, then its ancestors by depth, then itself: the runtime lists tree nodes parents first),
    then the slots it does not see. A tree node's masked siblings then never shift its ancestors' terms within
    the softmax's sum or the probabilities x values sum, so its row is computed as the plain step of its token
    computes it (the ``ort`` form is ``exporter/export/ort_gathered.py``; the step plan's probe checks both).

    ``q`` ``[B, Hq, T, D]`` (rotated), ``keys``/``values`` ``[B, Hkv, C, D]`` (the step's rows written),
    ``mask`` ``[B, 1, T, C]`` additive (0 where visible). Returns the context ``[B, T, Hq * D]``. Each row
    multiplies its own copy of the values in its order (a ``G x C`` by ``C x D`` product per row)."""
    bsz, hq, t, d = q.shape
    hkv, cap = keys.shape[1], keys.shape[2]
    group = hq // hkv
    slots = torch.arange(cap, device=q.device)
    order = torch.argsort(slots + (mask[:, 0] < 0).to(slots.dtype) * cap, dim=-1)  # [B, T, C]
    qg = q.view(bsz, hkv, group, t, d).transpose(2, 3).reshape(bsz, hkv, t * group, d)  # row t*G + g
    scores = (torch.matmul(qg, keys.transpose(2, 3)) * scale).view(bsz, hkv, t, group, cap)
    scores = torch.gather(scores, -1, order[:, None, :, None, :].expand(bsz, hkv, t, group, cap))
    scores = scores + torch.gather(mask[:, 0], -1, order)[:, None, :, None, :]
    probs = torch.softmax(scores, dim=-1)  # [B, Hkv, T, G, C]
    rows = torch.gather(values[:, :, None].expand(bsz, hkv, t, cap, d), 3,
                        order[:, None, :, :, None].expand(bsz, hkv, t, cap, d))  # [B, Hkv, T, C, D]
    ctx = torch.matmul(probs, rows)  # [B, Hkv, T, G, D]
    return ctx.permute(0, 2, 1, 3, 4).reshape(bsz, t, hq * d)


def example_inputs(step: BaseStep, batch: int = 2, t: int = 3, capacity: int = 8) -> tuple[torch.Tensor, ...]:
    """Trace inputs with every dynamic dimension >= 2 (dynamo specialises dimensions of 0 and 1)."""
    past_len = capacity - t - 1
    ids = torch.randint(0, step.embed_tokens.num_embeddings, (batch, t))
    pos = (past_len + torch.arange(t)).expand(batch, t).contiguous()
    mask = torch.full((batch, 1, t, capacity), torch.finfo(torch.float32).min)
    mask[..., : past_len + 0] = 0.0
    for j in range(t):
        mask[:, :, j, past_len : past_len + j + 1] = 0.0
    widx = past_len + torch.arange(t)
    lidx = torch.arange(t)
    dtype = step.embed_tokens.weight.dtype
    past = [
        torch.randn(batch, step.num_kv_heads, capacity, step.head_dim, dtype=dtype) for _ in range(2 * step.num_layers)
    ]
    return (ids, pos, mask.to(dtype), widx, lidx, past)
