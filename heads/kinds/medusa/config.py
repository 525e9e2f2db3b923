"""The run config's ``drafter.medusa`` section: the options of Medusa-1 and Medusa-2.

Declared by the kind (``DrafterKind.section``), parsed and checked by ``selfdraft.configs.run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal


@dataclass(frozen=True)
class LoraConfig:
    """Medusa-2: joint training of the heads and LoRA adapters on the target (rank 0 = Medusa-1).

    With LoRA the target changes: the LoRA-merged model that the run exports is the target whose
    distribution the decoder preserves, not the original model.
    """

    rank: int = 0
    """LoRA rank; 0 keeps the target frozen (Medusa-1)."""
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Linear layers of the target that get adapters (names as in the model)."""
    lm_loss: Literal["kl", "ce"] = "kl"
    """The target's own loss in the combined objective: KL to the original (adapter-free) model's
    next-token distribution (keeps its answers), or cross-entropy on the data's tokens."""
    lm_loss_weight: float = 1.0
    """Weight of the target's own loss next to the heads' loss."""


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads: K heads of L residual blocks on the target's final hidden state."""

    UPGRADED_KEYS: ClassVar[dict[str, str]] = {"tree_nodes": "max_nodes"}
    """Keys of this section in configs written by selfdraft 0.1, now ``drafter.tree.<value>``."""

    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = False
    """Give every head its own vocabulary projection (K x V x D more weights) instead of the target's."""
    labels: Literal["target", "data"] = "target"
    """What head k at position t learns: the target's own distribution for token t+2+k (self-distilled
    soft labels, computed on the fly) or the data's token t+2+k (the Medusa paper's hard labels)."""
    position_fraction: float = 1.0
    """Share of eligible positions per head (drawn at random each step) that enter the training loss.
    Below 1 it trades positions per sequence for sequences per second where the vocabulary projection
    dominates the cost (a CPU); evaluation always uses every position."""
    head_decay: float = 0.8
    """Loss weight of head k is head_decay**k (later heads are harder and matter less)."""
    tree_ranks: int = 10
    """Top-ranks measured per head for the sparse tree (accuracy of rank r for r < tree_ranks); its node
    budget is ``drafter.tree.max_nodes``."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def problems(self, run) -> list[str]:
        """What is wrong with this section in the run config ``run`` (messages naming the dotted keys)."""
        checks = [
            (self.num_heads >= 1 and self.num_layers >= 0, "drafter.medusa needs num_heads >= 1 and num_layers >= 0"),
            (0 < self.position_fraction <= 1, "drafter.medusa.position_fraction must be in (0, 1]"),
            (0 < self.head_decay <= 1, "drafter.medusa.head_decay must be in (0, 1]"),
            (self.tree_ranks >= 1, "drafter.medusa.tree_ranks must be >= 1"),
            (self.lora.rank >= 0 and self.lora.lm_loss_weight >= 0,
             "drafter.medusa.lora.rank and lm_loss_weight must be >= 0"),
        ]
        return [message for ok, message in checks if not ok]
