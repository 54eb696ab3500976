"""The Cerberus gate as one tiny graph: entropy of the base distribution and a learned acceptance gate.

    hidden_states [B, N, H]  base hidden state of the last accepted node
    logits        [B, N, V]  base logits there (they produced the root token)
  ->
    entropy       [B, N]     nats; the paper's gate drafts when it is below a threshold
    gate_prob     [B, N]     learned P(the step accepts at least one draft token)

The learned gate is a small MLP on ``[h ; entropy ; max log-prob]``: the hidden state carries the
context, the two scalars are what the entropy gate sees (an MLP of this width cannot derive the
entropy of a 49k-way softmax from h by itself). It is trained from logged acceptance by the
calibration step, so its weights start random and mean nothing until then.
"""

from __future__ import annotations

import torch
from torch import nn

GATE_WIDTH = 32


class GateGraph(nn.Module):
    def __init__(self, hidden_size: int, width: int = GATE_WIDTH):
        super().__init__()
        self.hidden_size = hidden_size
        self.mlp = nn.Sequential(nn.Linear(hidden_size + 2, width), nn.SiLU(), nn.Linear(width, 1))

    @staticmethod
    def entropy_features(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [B, N, V]
        entropy = -(logp.exp() * logp).sum(-1)  # [B, N]
        return entropy, logp.max(-1).values

    def gate_logit(self, hidden: torch.Tensor, entropy: torch.Tensor, max_logp: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, entropy.unsqueeze(-1), max_logp.unsqueeze(-1)], dim=-1)  # [B, N, H+2]
        return self.mlp(x).squeeze(-1)  # [B, N]

    def forward(self, hidden_states: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entropy, max_logp = self.entropy_features(logits)
        return entropy, torch.sigmoid(self.gate_logit(hidden_states, entropy, max_logp))


def example_gate_inputs(hidden_size: int, vocab_size: int, batch: int = 2, rows: int = 3):
    """Trace inputs with every dynamic dimension >= 2."""
    return torch.randn(batch, rows, hidden_size), torch.randn(batch, rows, vocab_size)
