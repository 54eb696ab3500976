"""Cerberus heads (arXiv 2410.13344): Medusa ResBlocks plus a sequential block that chains the heads.

    z_k   = RB_k(h_t)                           ResBlock H -> H, W zero-init
    z'_k  = z_k + SiLU(W'_k [z_k ; z'_{k-1}])   "RB'_k": 2H -> H with the residual on z_k, W' zero-init
    p_k   = softmax(LM(z'_k))                   shared base lm_head (or the trimmed draft vocabulary)

``z'_{-1}`` is zeros: head 0 then has the same two-block depth as every other head, and all heads
keep one structure. Knowledge flows from head k-1 to head k through hidden states, not sampled
tokens, so every head still runs in one forward pass. At initialisation ``z'_k = z_k = h_t``.
"""

from __future__ import annotations

import torch
from torch import nn

from .heads import HeadsConfig, HeadsModule, ResBlock
from .kinds import CERBERUS


class CerberusHeads(HeadsModule):
    kind = CERBERUS

    def __init__(self, config: HeadsConfig):
        super().__init__(config)
        h = config.hidden_size
        self.blocks = nn.ModuleList(ResBlock(h) for _ in range(config.num_heads))  # RB_k
        self.seq_blocks = nn.ModuleList(ResBlock(2 * h, h) for _ in range(config.num_heads))  # RB'_k

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        prev = torch.zeros_like(h)  # z'_{-1}
        outs = []
        for block, seq in zip(self.blocks, self.seq_blocks):
            z = block(h)  # [..., H]
            prev = seq(torch.cat([z, prev], dim=-1), residual=z)  # [..., H]
            outs.append(prev)
        return torch.stack(outs, dim=-2)  # [..., K, H]
