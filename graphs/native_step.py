"""``BaseStep`` built from plain tensors: no transformers, no source model.

The torch backend rebuilds the base step from the weights a bundle already holds (its fp32 ``ort``
graph, see ``exporter/reference/torch_backend.py``), and the GPU check times the real architecture
with random weights built from its shape alone, so that no model has to travel to the device.

Weights are named as the bundle's ``ort`` graph names its initializers (``ort_graph.py``):

    embed_tokens [V, H]          lm_head_t [H, V]          final_norm [H]
    rotary_cos, rotary_sin [P, D/2]  (the model's own rotary tables, scaling included)
    layers.{i}.input_norm [H]    layers.{i}.qkv_t [H, (Hq + 2 Hkv) D]   layers.{i}.qkv_bias (optional)
    layers.{i}.o_proj_t [Hq D, H]  layers.{i}.post_norm [H]  layers.{i}.gate_up_t [H, 2 I]  layers.{i}.down_t [I, H]

Matrices are stored transposed (``x @ W``), as the graph multiplies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base_step import BaseStep, FusedBlock


@dataclass(frozen=True)
class StepShape:
    """The base step's architecture: what random weights need, and what real ones are checked against."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float = 10000.0
    max_positions: int = 2048
    qkv_bias: bool = False


class TableRotary(nn.Module):
    """cos/sin at ``position_ids`` from precomputed ``[P, D/2]`` tables (the halves duplicated, the
    rotate-half form transformers uses), in the dtype of ``x``."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[position_ids], self.sin[position_ids]  # [B, T, D/2]
        return torch.cat((cos, cos), dim=-1).to(x.dtype), torch.cat((sin, sin), dim=-1).to(x.dtype)


def rotary_tables(head_dim: int, theta: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) rotary tables ``[positions, head_dim/2]``, computed as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def _linear(weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    lin = nn.Linear(weight_t.shape[0], weight_t.shape[1], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight_t.t().contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def step_from_weights(weights: dict[str, torch.Tensor], shape: StepShape,
                      feature_layers: tuple[int, ...] = ()) -> BaseStep:
    """The base step over ``weights`` (named as above); KeyError or ValueError when they do not fit ``shape``.
    ``feature_layers`` adds the tapped decoder layers' residual outputs (``layer_states``, for EAGLE-3 drafts)."""
    s = shape
    q_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    expect = {"embed_tokens": (s.vocab_size, s.hidden_size), "lm_head_t": (s.hidden_size, s.vocab_size),
              "final_norm": (s.hidden_size,)}
    for i in range(s.num_layers):
        p = f"layers.{i}."
        expect |= {p + "input_norm": (s.hidden_size,), p + "qkv_t": (s.hidden_size, q_out),
                   p + "o_proj_t": (s.num_heads * s.head_dim, s.hidden_size), p + "post_norm": (s.hidden_size,),
                   p + "gate_up_t": (s.hidden_size, 2 * s.intermediate_size),
                   p + "down_t": (s.intermediate_size, s.hidden_size)}
    for name, dims in expect.items():
        if tuple(weights[name].shape) != dims:
            raise ValueError(f"weight '{name}' has shape {tuple(weights[name].shape)}, expected {dims}")
    blocks = []
    for i in range(s.num_layers):
        p = f"layers.{i}."
        norms = (_param(weights[p + "input_norm"]), s.rms_norm_eps, _param(weights[p + "post_norm"]), s.rms_norm_eps)
        blocks.append(FusedBlock(_linear(weights[p + "qkv_t"], weights.get(p + "qkv_bias")),
                                  _linear(weights[p + "o_proj_t"]), _linear(weights[p + "gate_up_t"]),
                                  _linear(weights[p + "down_t"]), norms, nn.SiLU()))
    embed = nn.Embedding(s.vocab_size, s.hidden_size, device="meta")
    embed.weight = _param(weights["embed_tokens"])
    if "rotary_cos" in weights:
        rotary = TableRotary(weights["rotary_cos"], weights["rotary_sin"])
    else:
        rotary = TableRotary(*rotary_tables(s.head_dim, s.rope_theta, s.max_positions))
    return BaseStep.from_parts(embed, blocks, (_param(weights["final_norm"]), s.rms_norm_eps),
                               _linear(weights["lm_head_t"]), rotary, (s.num_heads, s.num_kv_heads, s.head_dim),
                               feature_layers)


def random_weights(shape: StepShape, seed: int = 0, std: float = 0.02, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights of ``shape`` (normal, ``std``; norms at 1), generated on ``device``: what step
    timings need, since they depend on shapes, not values. The lm_head is tied to the embedding."""
    s = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen, device=device, dtype=torch.float32).mul_(std).to(dtype)

    ones = torch.ones(s.hidden_size, device=device, dtype=dtype)
    embed = normal(s.vocab_size, s.hidden_size)
    w = {"embed_tokens": embed, "lm_head_t": embed.t(), "final_norm": ones}
    q_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    for i in range(s.num_layers):
        p = f"layers.{i}."
        w |= {p + "input_norm": ones, p + "qkv_t": normal(s.hidden_size, q_out),
              p + "o_proj_t": normal(s.num_heads * s.head_dim, s.hidden_size), p + "post_norm": ones,
              p + "gate_up_t": normal(s.hidden_size, 2 * s.intermediate_size),
              p + "down_t": normal(s.intermediate_size, s.hidden_size)}
        if s.qkv_bias:
            w[p + "qkv_bias"] = normal(q_out)
    return w
