"""Shared pieces of the parallel decoding heads (Medusa, Cerberus): ResBlock, config, and the export wrapper.

A heads module maps the base hidden state ``h_t`` (the lm_head input) to one feature vector per head,
``z [..., K, H]``. Head k (0-based) predicts the token at offset ``t+2+k``: the base's own logits at t
give the root ``t+1``, so at decode time head k proposes the token k+1 places after the root.

Every head shares the base model's lm_head (or a row subset of it, the trimmed draft vocabulary), so
no head carries its own V x H projection. :class:`DraftHeadsGraph` adds that projection plus
log-softmax and TopK, which keeps the big matmul inside ONNX Runtime and lets only small arrays
cross to Python::

    hidden_states  [B, N, H]  float32
  ->
    topk_ids       [B, N, K, k]  int64   full-vocabulary token ids, best first
    topk_logprobs  [B, N, K, k]  float32 log-probabilities (over the draft vocabulary)

This package imports neither ``exporter`` nor ``runtime``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


class ResBlock(nn.Module):
    """``residual + SiLU(W x + b)`` with W and b zero-initialised, so a fresh block is the identity.

    ``d_in`` may exceed ``d_out`` (Cerberus' sequential block reads ``[z_k ; z'_{k-1}]``); the residual
    is then given explicitly.
    """

    def __init__(self, d_in: int, d_out: int | None = None):
        super().__init__()
        d_out = d_out or d_in
        self.linear = nn.Linear(d_in, d_out)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        res = x if residual is None else residual
        return res + nn.functional.silu(self.linear(x))


@dataclass(frozen=True)
class HeadsConfig:
    """What a heads module is and which base model it belongs to (stored in the weights' metadata)."""

    kind: str  # "medusa" | "cerberus"
    num_heads: int
    hidden_size: int
    vocab_size: int
    layers: int = 1  # ResBlocks per head before the shared lm_head (Medusa); Cerberus uses 1 + 1 sequential
    base_weight_sha: str = ""

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.layers < 1 or self.hidden_size < 1 or self.vocab_size < 1:
            raise ValueError(f"invalid heads config {self}")

    def to_dict(self) -> dict:
        return asdict(self)


class HeadsModule(nn.Module):
    """Base class: ``forward(h [..., H]) -> z [..., K, H]``, all heads in one pass."""

    config: HeadsConfig
    kind: str = ""

    def __init__(self, config: HeadsConfig):
        super().__init__()
        if config.kind != self.kind:
            raise ValueError(f"{type(self).__name__} needs a {self.kind} config, got {config.kind!r}")
        self.config = config

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class DraftHeadsGraph(nn.Module):
    """Heads + shared (optionally trimmed) lm_head + log-softmax + TopK: the traced draft graph.

    ``lm_weight`` is the base lm_head weight [V, H] (shared with the base model, not copied). With
    ``vocab_map`` [V'] only those rows are projected and the TopK indices are mapped back to full ids.
    """

    def __init__(self, heads: HeadsModule, lm_weight: torch.Tensor, topk: int = 10,
                 vocab_map: torch.Tensor | None = None):
        super().__init__()
        self.heads = heads
        attach_draft_vocab(self, lm_weight, vocab_map, topk)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.heads(hidden_states)  # [B, N, K, H]
        return draft_topk(self, z)  # [B, N, K, k] each, best first


def attach_draft_vocab(module: nn.Module, lm_weight: torch.Tensor, vocab_map: torch.Tensor | None, topk: int) -> None:
    """Give ``module`` the shared lm_head rows it projects onto (all, or ``vocab_map``'s) and its top-k size.

    Buffers are not persistent: the base model's weight is shared, never saved with a draft.
    """
    module.topk = int(topk)
    if vocab_map is not None:
        vocab_map = vocab_map.to(torch.int64)
        module.register_buffer("vocab_map", vocab_map, persistent=False)
        module.register_buffer("lm_weight", lm_weight.detach()[vocab_map].contiguous(), persistent=False)
    else:
        module.vocab_map = None
        module.register_buffer("lm_weight", lm_weight.detach(), persistent=False)
    if module.topk > module.lm_weight.shape[0]:
        raise ValueError(f"topk {topk} exceeds the draft vocabulary ({module.lm_weight.shape[0]})")


def draft_topk(module: nn.Module, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Project ``z [..., H]`` on ``module``'s draft vocabulary: (full-vocabulary ids, log-probs), ``[..., k]``."""
    logp = torch.log_softmax(torch.matmul(z, module.lm_weight.t()), dim=-1)
    values, idx = torch.topk(logp, module.topk, dim=-1)
    if module.vocab_map is not None:
        idx = module.vocab_map[idx]  # back to full-vocabulary ids
    return idx, values


def example_hidden(hidden_size: int, batch: int = 2, rows: int = 3) -> torch.Tensor:
    """Trace input with every dynamic dimension >= 2 (dynamo specialises dimensions of 0 and 1)."""
    return torch.randn(batch, rows, hidden_size)
