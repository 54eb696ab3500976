"""Medusa-1 heads: head k = ResBlock^L(h_t), projected by the shared base lm_head, predicts token t+2+k.

The heads are independent of one another (that is what Cerberus changes). With W zero-initialised a
fresh head returns ``h_t`` itself, i.e. it starts by predicting the base model's next token.
"""

from __future__ import annotations

import torch
from torch import nn

from .heads import HeadsConfig, HeadsModule, ResBlock
from .kinds import MEDUSA


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(layers))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h


class MedusaHeads(HeadsModule):
    kind = MEDUSA

    def __init__(self, config: HeadsConfig):
        super().__init__(config)
        # One module per head (a list comprehension, never ``[m] * n``, which would share weights).
        self.heads = nn.ModuleList(MedusaHead(config.hidden_size, config.layers) for _ in range(config.num_heads))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(h) for head in self.heads], dim=-2)  # [..., K, H]
