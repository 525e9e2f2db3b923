"""The run config's ``drafter.eagle`` section: the options of the EAGLE kinds (``eagle``, ``eagle3``).

Declared by the kind (``DrafterKind.section``), parsed and checked by ``selfdraft.configs.run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal


@dataclass(frozen=True)
class EagleConfig:
    """EAGLE-1 (``kind: eagle``) and EAGLE-3 (``kind: eagle3``) feature drafters."""

    UPGRADED_KEYS: ClassVar[dict[str, str]] = {"tree_depth": "depth", "tree_top_k": "top_k", "tree_nodes": "max_nodes"}
    """Keys of this section in configs written by selfdraft 0.1, now ``drafter.tree.<value>``."""

    layer: Literal["llama", "target"] = "llama"
    """The draft decoder layer: a Llama layer shaped like the target (what vLLM and SGLang build for
    every EAGLE drafter, whatever the target's family: no q/k/v biases, no q/k norms), or the target
    family's own layer class (decodes here; engines cannot load it, and export to them is refused)."""

    regression_weight: float = 1.0
    """EAGLE-1: weight of the smooth-L1 regression of the next feature."""
    kl_weight: float = 0.1
    """EAGLE-1: weight of the KL to the target's next-token distribution (EAGLE-3 uses the KL alone)."""
    feature_noise: float = 0.1
    """EAGLE-1: uniform noise (+-feature_noise) added to input features while training."""
    ttt_steps: int = 3
    """EAGLE-3 training-time test: steps the drafter is unrolled on its own outputs."""
    step_decay: float = 0.8
    """EAGLE-3: loss weight of unrolled step j is step_decay**j."""
    draft_vocab_size: int = 8192
    """EAGLE-3: the most frequent target tokens (assistant tokens of the training data) it drafts from."""
    aux_layers: list[int] = field(default_factory=list)
    """EAGLE-3: the target layers fused, as transformers ``hidden_states`` indices (index i is the
    input of decoder layer i); empty for the engines' default (2, L//2, L-3). Exports translate them
    into each engine's own convention."""

    def problems(self, run) -> list[str]:
        """What is wrong with this section in the run config ``run`` (messages naming the dotted keys)."""
        checks = [
            (self.ttt_steps >= 1 and 0 < self.step_decay <= 1, "drafter.eagle needs ttt_steps >= 1 and step_decay in (0, 1]"),
            (self.draft_vocab_size >= 2, "drafter.eagle.draft_vocab_size must be >= 2"),
        ]
        return [message for ok, message in checks if not ok]
