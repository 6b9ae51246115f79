"""Medusa heads: ``K`` residual blocks on the target's last hidden state, head ``k`` predicting token ``t + 2 + k``.

Cai et al. 2024, "Medusa". Head ``k`` (0-based) maps the target's final-norm feature at position ``t`` through
``num_layers`` residual blocks ``x + SiLU(W x + b)`` and an LM head to the distribution of token ``t + 2 + k``
(the target itself predicts ``t + 1``). Heads trained here share the target's frozen LM head; a published
Medusa-1 checkpoint carries one vocabulary projection per head (``medusa_head.{k}.{num_layers}.weight``), which
is then used instead. Weights use Medusa's layout ``medusa_head.{k}.{layer}.linear.{weight,bias}``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))``; the linear starts at zero, so an untrained head is the identity (Medusa's init)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` heads of ``num_layers`` residual blocks each, with optional own LM heads.

    Args:
        hidden_size: the target's hidden size.
        num_heads: ``K``, the most tokens one proposal drafts.
        num_layers: residual blocks per head.
        vocab_size: when given, each head gets its own ``[vocab_size, hidden_size]`` projection (Medusa-1
            checkpoints); None: the caller applies the target's LM head.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1, vocab_size: int | None = None) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.num_layers = hidden_size, num_heads, num_layers
        self.vocab_size = vocab_size
        self.own_lm_heads = vocab_size is not None
        self.medusa_head = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(hidden_size) for _ in range(num_layers)],
                *([nn.Linear(hidden_size, vocab_size, bias=False)] if vocab_size is not None else []),
            )
            for _ in range(num_heads)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` features -> ``[num_heads, n, hidden_size]`` (or ``[num_heads, n, vocab_size]``
        logits when the heads have their own LM heads)."""
        return torch.stack([head(features) for head in self.medusa_head])
