"""Medusa heads: K extra decoding heads on the target's last hidden state (weights and forward only).

Head k (k = 0..K-1) reads the target's final normed hidden state at position t, the features that
produced token t+1, and predicts token t+2+k. Each head is L residual blocks ``x + SiLU(W x + b)``
followed by a vocabulary projection: its own, or the target's LM head passed in at call time (on
small models the shared head keeps the drafter small). Blocks start at zero (W = 0, b = 0), so every
head starts as the target's own next-token head, as in the Medusa paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from selfdraft.errors import SelfdraftError
from selfdraft.heads.registry import Dims


@dataclass(frozen=True)
class MedusaDims(Dims):
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int
    """Residual blocks per head."""
    own_lm_head: bool
    """Each head has its own vocabulary projection; else they share the target's LM head."""


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of L residual blocks each, with their own vocabulary projections or none (shared).

    forward(hidden (..., D), lm_head) -> logits (K, ..., V). ``lm_head`` is the target's output
    projection, used when the heads share it (``own_lm_head=False``), ignored otherwise.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1, own_lm_head: bool = False):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise SelfdraftError(f"Medusa heads need num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        # Distinct modules per head and per layer (never list multiplication of one instance).
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(hidden_size) for _ in range(num_layers))) for _ in range(num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads)) if own_lm_head else None
        )

    @classmethod
    def from_dims(cls, dims: MedusaDims) -> "MedusaHeads":
        return cls(dims.hidden_size, dims.vocab_size, dims.num_heads, dims.num_layers, dims.own_lm_head)

    @property
    def dims(self) -> MedusaDims:
        return MedusaDims(hidden_size=self.hidden_size, vocab_size=self.vocab_size, num_heads=self.num_heads,
                          num_layers=len(self.blocks[0]), own_lm_head=self.lm_heads is not None)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def head_logits(self, k: int, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Head k's logits (..., V) from hidden states (..., D)."""
        if hidden.shape[-1] != self.hidden_size:
            raise SelfdraftError(f"hidden size {hidden.shape[-1]} != the heads' {self.hidden_size}: these heads are for another target")
        if self.lm_heads is None and lm_head is None:
            raise SelfdraftError("these heads share the target's LM head: pass it as lm_head")
        features = self.blocks[k](hidden)  # (..., D)
        return (self.lm_heads[k] if self.lm_heads is not None else lm_head)(features)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        return torch.stack([self.head_logits(k, hidden, lm_head) for k in range(self.num_heads)])  # (K, ..., V)
