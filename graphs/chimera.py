"""Chimera draft model (arXiv 2402.15758): trigram encoder, one full-context decoder layer, residual heads.

Notation: the base model has run over tokens ``x_0..x_{t}``; ``h_j`` is its last hidden state (the
lm_head input) at position j, and its argmax at ``t`` gave the root ``x_{t+1}``, which is not yet in
the base cache. The draft predicts ``x_{t+2}, x_{t+3}, ...``.

* **Trigram encoder.** ``e_m = W_o(u + SiLU(W u))`` over ``u = [E(x_{m-2}); E(x_{m-1}); E(x_m)]``, with
  the base model's own (frozen) embedding table E. At the first positions the earliest token is
  repeated. W starts at zero and W_o at ``[0 | 0 | I]``, so a fresh encoder returns ``E(x_m)``.
* **Full-context encoder.** One decoder layer of the base model's width (RMSNorm, GQA attention with
  RoPE, SwiGLU MLP). Draft slot j reads ``fuse([h_j ; e_{j+1}])``: the base hidden state at j and the
  trigram ending at the next token. With causal masking over the slots, slot j therefore sees
  ``h_<=j`` and the trigram features up to ``j+1``, as the paper's two-halves sequence
  ``[h_1..h_n || e_2..e_{n+1}]`` does, at half the sequence length and half the draft KV. Its output
  ``f_{j+1}`` (after an RMSNorm initialised from the base's final norm) predicts ``h_{j+1}``.
* **Deeper drafts.** The layer is reused: the slot after the last real one reads
  ``fuse([f_{t+1} ; e_{t+2}])``, where ``e_{t+2}`` is the trigram ending at the previous head's argmax,
  and so on (feeding the predicted feature where the base's is not known yet, as EAGLE does).
* **Residual decoding heads.** Head k (1-based) reads the base state ``h_t`` and the draft feature
  ``f_{t+k}``: ``z_k = f_{t+k} + SiLU(W_k [h_t ; f_{t+k}] + b_k)`` with ``W_k`` (2H -> H) zero-initialised,
  then the base lm_head (shared, or a trimmed draft vocabulary mapped back to full ids) gives the
  logits of ``x_{t+k+1}``. No head carries its own V x 2H projection.

Two modules here: :class:`ChimeraDraft` (the trainable weights, with the unrolled parallel forward
used by training) and :class:`ChimeraStepGraph` (one draft step over an in-place draft KV cache, the
graph that is exported to ONNX). This package imports neither ``exporter`` nor ``runtime``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from .base_step import rms_norm
from .heads import attach_draft_vocab, draft_topk
from .kinds import CHIMERA


@dataclass(frozen=True)
class ChimeraConfig:
    """Shape of a Chimera draft and which base model it belongs to (stored in the weights' metadata)."""

    kind: str  # always "chimera"
    num_heads: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    base_weight_sha: str = ""
    # EAGLE-3-style fusion: the base decoder layers (0-based; their residual outputs) whose states feed the
    # real draft slots, instead of the last hidden state alone. Empty: the last hidden state (Chimera).
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.kind != CHIMERA:
            raise ValueError(f"a ChimeraConfig has kind '{CHIMERA}', not {self.kind!r}")
        if self.num_heads < 1 or self.hidden_size < 1 or self.vocab_size < 1 or self.head_dim < 2:
            raise ValueError(f"invalid chimera config {self}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def for_base(cls, base_config, num_heads: int = 4, base_weight_sha: str = "",
                 feature_layers: tuple[int, ...] = ()) -> ChimeraConfig:
        """The draft shape for a Hugging Face Llama-family config: one layer of the base's width."""
        c = base_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta = getattr(c, "rope_theta", None)
        if theta is None:
            theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(CHIMERA, int(num_heads), int(c.hidden_size), int(c.vocab_size), int(c.num_attention_heads),
                   int(c.num_key_value_heads), int(head_dim), int(c.intermediate_size), float(c.rms_norm_eps),
                   float(theta), base_weight_sha, tuple(feature_layers))

    def to_dict(self) -> dict:
        return asdict(self)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high taps for a base of ``num_layers`` decoder layers."""
    if num_layers < 4:
        raise ValueError("feature fusion needs a base of at least 4 decoder layers")
    return (1, num_layers // 2 - 1, num_layers - 4)


def feature_layers_option(value: str | tuple[int, ...] | None, num_layers: int) -> tuple[int, ...]:
    """``--feature-layers``: "" (none), "eagle3" (:func:`default_feature_layers`) or "1,14,26"."""
    if value is None or not isinstance(value, str):
        return tuple(value or ())
    value = value.strip().lower()
    if value == "eagle3":
        return default_feature_layers(num_layers)
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated layer numbers or 'eagle3', got '{value}'") from None


class LayerFusion(nn.Module):
    """EAGLE-3's fusion of low, mid and high base features into one slot input: ``W [n(s_1); ..; n(s_L)]``.

    Each tapped residual state is RMS-normalised with its own learned weight (the raw residual stream's
    scale grows with depth), then one linear map takes the concatenation to the hidden width. It starts as
    "the deepest tap, normalised", close to the base's last hidden state that a plain Chimera reads.
    """

    def __init__(self, hidden: int, taps: int, eps: float):
        super().__init__()
        self.eps = eps
        self.norms = nn.Parameter(torch.ones(taps, hidden))
        self.proj = nn.Linear(taps * hidden, hidden, bias=False)
        nn.init.normal_(self.proj.weight, std=0.02 / taps)
        with torch.no_grad():
            self.proj.weight[:, (taps - 1) * hidden :] += torch.eye(hidden)

    def forward(self, layers: torch.Tensor) -> torch.Tensor:
        """``layers [..., L*H]`` (the taps side by side) -> ``[..., H]``."""
        taps, hidden = self.norms.shape
        x = layers.unflatten(-1, (taps, hidden))
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norms
        return self.proj(x.flatten(-2))


class TrigramEncoder(nn.Module):
    """``e = W_o(u + SiLU(W u))`` over the concatenated embeddings of three consecutive tokens."""

    def __init__(self, hidden: int):
        super().__init__()
        self.mix = nn.Linear(3 * hidden, 3 * hidden)
        nn.init.zeros_(self.mix.weight)
        nn.init.zeros_(self.mix.bias)
        self.out = nn.Linear(3 * hidden, hidden, bias=False)
        with torch.no_grad():  # start as "the embedding of the newest token"
            self.out.weight.zero_()
            self.out.weight[:, 2 * hidden :] = torch.eye(hidden)

    def forward(self, emb3: torch.Tensor) -> torch.Tensor:
        """``emb3 [..., 3, H]`` (oldest first) -> ``[..., H]``."""
        u = emb3.flatten(-2)
        return self.out(u + nn.functional.silu(self.mix(u)))


class DraftLayer(nn.Module):
    """One Llama-style decoder layer, split so training and the exported step can attend differently."""

    def __init__(self, c: ChimeraConfig):
        super().__init__()
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv = nn.Linear(c.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, c.hidden_size, bias=False)
        self.post_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        for lin in (self.qkv, self.o_proj, self.gate_up, self.down):
            nn.init.normal_(lin.weight, std=0.02)
        nn.init.zeros_(self.o_proj.weight)  # a fresh layer adds nothing to its input
        nn.init.zeros_(self.down.weight)

    def qkv_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [B, T, H]`` -> rotated q ``[B, Hq, T, D]``, k and v ``[B, Hkv, T, D]``."""
        b, t, _ = x.shape
        q, k, v = self.qkv(rms_norm(x, self.input_norm, self.eps)).split(
            [self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = q.view(b, t, self.hq, self.d).transpose(1, 2)
        k = k.view(b, t, self.hkv, self.d).transpose(1, 2)
        v = v.view(b, t, self.hkv, self.d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """Residual attention output, then the MLP. ``ctx [B, Hq, T, D]``."""
        b, _, t, _ = ctx.shape
        x = x + self.o_proj(ctx.transpose(1, 2).reshape(b, t, self.hq * self.d))
        gate, up = self.gate_up(rms_norm(x, self.post_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ChimeraDraft(nn.Module):
    """The trainable draft. The base embedding and lm_head are frozen inputs, never stored with it."""

    def __init__(self, config: ChimeraConfig):
        super().__init__()
        self.config = config
        h, k = config.hidden_size, config.num_heads
        self.trigram = TrigramEncoder(h)
        self.fuse = nn.Linear(2 * h, h, bias=False)
        nn.init.normal_(self.fuse.weight, std=0.02)
        with torch.no_grad():  # start by passing the base hidden state through
            self.fuse.weight[:, :h] += torch.eye(h)
        self.layer = DraftLayer(config)
        self.fusion = (LayerFusion(h, len(config.feature_layers), config.rms_norm_eps)
                       if config.feature_layers else None)
        self.out_norm = nn.Parameter(torch.ones(h))
        self.head_weight = nn.Parameter(torch.zeros(k, 2 * h, h))  # [K, 2H, H]: z = f + SiLU([h; f] W + b)
        self.head_bias = nn.Parameter(torch.zeros(k, h))
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [B, T]`` -> cos, sin ``[B, 1, T, D]``."""
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()

    def slot_input(self, hidden: torch.Tensor, emb3: torch.Tensor) -> torch.Tensor:
        """``fuse([h ; trigram])``: ``hidden [B, T, H]``, ``emb3 [B, T, 3, H]`` -> ``[B, T, H]``."""
        return self.fuse(torch.cat([hidden, self.trigram(emb3)], dim=-1))

    def feature(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.out_norm, self.config.rms_norm_eps)

    def head(self, base_hidden: torch.Tensor, feat: torch.Tensor, k: torch.Tensor | int) -> torch.Tensor:
        """Residual head(s): ``base_hidden, feat [..., H]``; ``k`` an index or a tensor of them (0-based)."""
        w, b = self.head_weight[k], self.head_bias[k]
        mixed = torch.matmul(torch.cat([base_hidden, feat], dim=-1).unsqueeze(-2), w).squeeze(-2) + b
        return feat + nn.functional.silu(mixed)

    def trigram_all(self, emb: torch.Tensor) -> torch.Tensor:
        """Trigram encodings ``e_m`` for every position m: ``emb [B, L, H]`` -> ``[B, L, H]``."""
        length = emb.shape[1]
        m = torch.arange(length, device=emb.device)
        tri = torch.stack([(m - 2).clamp(min=0), (m - 1).clamp(min=0), m], dim=-1)  # earliest token repeated
        return self.trigram(emb[:, tri])

    def real_input(self, hidden: torch.Tensor, layers: torch.Tensor | None = None) -> torch.Tensor:
        """What a real slot reads: the base hidden state, or with feature fusion the fused tapped layers."""
        if self.fusion is None:
            return hidden
        if layers is None:
            raise ValueError("this draft fuses base layers: pass their states")
        return self.fusion(layers)

    def unrolled(self, emb: torch.Tensor, hidden: torch.Tensor, depth: int,
                 layers: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training forward for every origin at once, ``depth`` draft steps deep.

        ``emb [B, L, H]`` are the base embeddings of the tokens and ``hidden [B, L, H]`` the base
        hidden states (``layers [B, L, taps*H]`` the tapped layers' states, for a fusing draft). Returns ``depth`` tensors ``[B, L, H]``: entry d-1 at origin i is ``f_{i+d}``,
        the feature predicting the token ``x_{i+d+1}``, computed exactly as decoding would: slot i
        reads the real ``h_i``; the depth-d slot (position ``i+d-1``) reads the depth-(d-1) feature and
        the trigram ending at ``x_{i+d}``, and attends to the real slots ``<= i`` plus its own chain.
        Rows with ``i + d >= L`` are garbage and must be masked by the caller.
        """
        bsz, length, _ = emb.shape
        hq, hkv, dh = self.layer.hq, self.layer.hkv, self.layer.d
        group = hq // hkv
        scale = dh**-0.5
        idx = torch.arange(length, device=emb.device)
        causal = idx[None, :] <= idx[:, None]  # [L, L] key <= query
        neg = torch.finfo(torch.float32).min
        e_all = self.trigram_all(emb)
        feats: list[torch.Tensor] = []
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        real_k = real_v = None
        prev = self.real_input(hidden, layers)
        for d in range(1, depth + 1):
            x = self.fuse(torch.cat([prev, e_all[:, (idx + d).clamp(max=length - 1)]], dim=-1))
            cos, sin = self.rope((idx + d - 1).expand(bsz, length))
            q, k, v = self.layer.qkv_heads(x, cos, sin)
            qg = q.reshape(bsz, hkv, group, length, dh)
            if d == 1:
                real_k, real_v = k, v
            # scores against the real slots (key <= origin) and against the chain (same origin)
            s_real = (torch.einsum("bhgqd,bhkd->bhgqk", qg, real_k) * scale).float().masked_fill(~causal, neg)
            if d == 1:
                probs = torch.softmax(s_real, dim=-1).to(v.dtype)
                ctx = torch.einsum("bhgqk,bhkd->bhgqd", probs, real_v)
            else:
                chain_k.append(k)
                chain_v.append(v)
                ck = torch.stack(chain_k, dim=-2)  # [B, Hkv, L, d-1, D]
                cv = torch.stack(chain_v, dim=-2)
                s_chain = (torch.einsum("bhgqd,bhqcd->bhgqc", qg, ck) * scale).float()
                probs = torch.softmax(torch.cat([s_real, s_chain], dim=-1), dim=-1).to(v.dtype)
                ctx = torch.einsum("bhgqk,bhkd->bhgqd", probs[..., :length], real_v)
                ctx = ctx + torch.einsum("bhgqc,bhqcd->bhgqd", probs[..., length:], cv)
            ctx = ctx.reshape(bsz, hq, length, dh)
            feat = self.feature(self.layer.finish(x, ctx))
            feats.append(feat)
            prev = feat
        return feats


class ChimeraStepGraph(nn.Module):
    """One draft step over an in-place draft KV cache, plus one residual head on the last row.

    Inputs::

        hidden          [B, T, H]     per slot: the base hidden state (real slots) or the fed-back feature
        trigram_ids     [B, T, 3]     int64 token ids of each slot's trigram, oldest first
        position_ids    [B, T]        int64
        attention_mask  [B, 1, T, C]  additive float
        write_indices   [T]           int64 draft-cache slots of the T new rows
        base_hidden     [B, H]        h_t, the newest real base hidden state (the heads' residual input)
        head_index      [1]           int64 which head (0-based) reads the last row
        past_key        [B, Hkv, C, D]
        past_value      [B, Hkv, C, D]

    Outputs: ``feature [B, H]`` (the last row's feature, fed back for the next depth),
    ``topk_ids [B, k]`` (full-vocabulary ids), ``topk_logprobs [B, k]``, and ``present_key`` /
    ``present_value`` (bind them to the past buffers: the scatter writes in place).
    """

    def __init__(self, draft: ChimeraDraft, embed_weight: torch.Tensor, lm_weight: torch.Tensor, topk: int = 10,
                 vocab_map: torch.Tensor | None = None):
        super().__init__()
        self.draft = draft
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        attach_draft_vocab(self, lm_weight, vocab_map, topk)
        # Every head's 2H -> H matrix side by side, [2H, K*H]: a constant MatMul weight, which weight-only
        # quantization can compress (a Gather of one head's slice would copy it in fp32 every call).
        k, two_h, h = draft.head_weight.shape
        self.register_buffer("head_w_all", draft.head_weight.detach().permute(1, 0, 2).reshape(two_h, k * h)
                             .contiguous(), persistent=False)

    def forward(self, hidden, trigram_ids, position_ids, attention_mask, write_indices, base_hidden, head_index,
                past_key, past_value):
        return self.step(hidden, trigram_ids, position_ids, attention_mask, write_indices, base_hidden, head_index,
                         past_key, past_value)

    def step(self, hidden, trigram_ids, position_ids, attention_mask, write_indices, base_hidden, head_index,
             past_key, past_value):
        draft, layer = self.draft, self.draft.layer
        bsz, t, _ = hidden.shape
        hq, hkv, dh = layer.hq, layer.hkv, layer.d
        group = hq // hkv
        emb3 = nn.functional.embedding(trigram_ids, self.embed_weight)  # [B, T, 3, H]
        x = draft.slot_input(hidden, emb3)
        cos, sin = (c.to(x.dtype) for c in draft.rope(position_ids))  # fp32 tables: in fp16/bf16, cast
        q, k, v = layer.qkv_heads(x, cos, sin)
        widx = write_indices.view(1, 1, t, 1).expand(bsz, hkv, t, dh)
        k_all = past_key.scatter(2, widx, k)  # [B, Hkv, C, D]
        v_all = past_value.scatter(2, widx, v)
        qg = q.reshape(bsz, hkv, group * t, dh)
        scores = torch.matmul(qg, k_all.transpose(2, 3)) * dh**-0.5
        scores = scores.view(bsz, hq, t, -1) + attention_mask
        probs = torch.softmax(scores, dim=-1).view(bsz, hkv, group * t, -1)
        ctx = torch.matmul(probs, v_all).view(bsz, hq, t, dh)
        feat = draft.feature(layer.finish(x, ctx))[:, -1]  # [B, H]
        mixed = torch.matmul(torch.cat([base_hidden, feat], dim=-1), self.head_w_all)  # [B, K*H]
        mixed = mixed.view(bsz, -1, feat.shape[-1]).index_select(1, head_index)[:, 0]  # [B, H]
        z = feat + nn.functional.silu(mixed + draft.head_bias.index_select(0, head_index))
        idx, values = draft_topk(self, z)  # [B, k] each
        return feat, idx, values, k_all, v_all


class FusedChimeraStepGraph(ChimeraStepGraph):
    """The step of a draft that fuses base layers (``feature_layers``): two more inputs.

    ``layer_states [B, T, taps*H]`` are the tapped base layers' states of real slots, and ``from_layers [1]``
    (float) is 1 where the call's slots are real (they read the fused taps) and 0 where they are chain slots
    (they read ``hidden``, the fed-back feature). The blend ``w * fused + (1 - w) * hidden`` is exact at 0 and 1.
    """

    def forward(self, hidden, layer_states, from_layers, trigram_ids, position_ids, attention_mask, write_indices,
                base_hidden, head_index, past_key, past_value):
        w = from_layers.view(1, 1, 1)
        slots = w * self.draft.fusion(layer_states) + (1.0 - w) * hidden
        return self.step(slots, trigram_ids, position_ids, attention_mask, write_indices, base_hidden, head_index,
                         past_key, past_value)


def trigram_ids(tokens, slots):
    """Trigram ids ``[len(slots), 3]`` for draft slots: slot j ends at token j+1, earliest token repeated.

    ``tokens`` is any indexable sequence of ids (the real ones plus the chain so far); works on lists,
    numpy and torch alike.
    """
    out = []
    for j in slots:
        m = j + 1
        out.append([tokens[max(m - 2, 0)], tokens[max(m - 1, 0)], tokens[m]])
    return out


def example_step_inputs(config: ChimeraConfig, batch: int = 2, t: int = 3, capacity: int = 8):
    """Trace inputs with every dynamic dimension >= 2 (dynamo specialises dimensions of 0 and 1)."""
    past_len = capacity - t - 1
    mask = torch.full((batch, 1, t, capacity), torch.finfo(torch.float32).min)
    mask[..., :past_len] = 0.0
    for j in range(t):
        mask[:, :, j, past_len : past_len + j + 1] = 0.0
    kv = (batch, config.num_key_value_heads, capacity, config.head_dim)
    fused = (torch.randn(batch, t, len(config.feature_layers) * config.hidden_size), torch.ones(1)) \
        if config.feature_layers else ()
    return (
        torch.randn(batch, t, config.hidden_size),
        *fused,
        torch.randint(0, config.vocab_size, (batch, t, 3)),
        (past_len + torch.arange(t)).expand(batch, t).contiguous(),
        mask,
        past_len + torch.arange(t),
        torch.randn(batch, config.hidden_size),
        torch.tensor([1], dtype=torch.int64),
        torch.randn(*kv),
        torch.randn(*kv),
    )
