"""The run config's ``drafter.block`` section: the options of the block kinds (``dflash``, ``dspark``).

Declared by the kind (``DrafterKind.section``), parsed and checked by ``selfdraft.configs.run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class BlockConfig:
    """Block drafters, DFlash (``kind: dflash``) and DSpark (``kind: dspark``): a whole block of tokens
    per drafter forward, conditioned on several target layers."""

    block_size: int = 4
    """Slots per block, the anchor included: DFlash drafts block_size - 1 tokens, DSpark block_size. 4 by
    measurement: docs/results/block-drafters.md."""
    num_layers: int = 1
    """Draft layers (Qwen3 layers shaped like the target). 1 by measurement: docs/results/block-drafters.md."""
    target_layers: list[int] = field(default_factory=list)
    """The fused target layers, as transformers ``hidden_states`` indices (i + 1 is decoder layer i's
    output); empty: three spread from the second layer to the fourth-last, as z-lab's DFlash picks them.
    Exports translate them into each engine's convention."""
    draft_vocab_size: int = 8192
    """The most frequent assistant tokens of the training data it drafts from, through its own LM head
    (rows of the target's to start); the target's vocabulary size: through the target's frozen head."""
    mask_token_id: int | None = None
    """The token fed at every slot after the anchor; unset: the largest id that is not the target's
    bos/eos/pad and never occurs in the training data. A token of the training data is refused."""
    anchors: int = 64
    """Blocks per sequence and step, their anchors drawn at random among assistant positions."""
    loss_decay: float = 4.0
    """gamma: the loss weight of the j-th drafted token is exp(-j / gamma)."""
    markov_rank: int = 64
    """DSpark: rank r of the Markov head."""
    confidence_head: bool = True
    """DSpark: train the confidence head (each slot's probability of being accepted)."""
    confidence_weight: float = 1.0
    """DSpark: weight of the confidence head's loss (binary cross-entropy against 1 - total variation
    between the drafter's and the target's distributions at that slot)."""

    def problems(self, run) -> list[str]:
        """What is wrong with this section in the run config ``run`` (messages naming the dotted keys)."""
        checks = [
            (self.block_size >= 2 and self.num_layers >= 1 and self.anchors >= 1,
             "drafter.block needs block_size >= 2, num_layers >= 1 and anchors >= 1"),
            (self.block_size < run.data.max_length,
             f"drafter.block.block_size {self.block_size} must be below data.max_length {run.data.max_length}"),
            (self.draft_vocab_size >= 2 and self.markov_rank >= 1, "drafter.block needs draft_vocab_size >= 2 and markov_rank >= 1"),
            (self.loss_decay > 0 and self.confidence_weight >= 0, "drafter.block needs loss_decay > 0 and confidence_weight >= 0"),
        ]
        return [message for ok, message in checks if not ok]
