"""Medusa (Medusa-1, and Medusa-2 with LoRA on the target): K heads on the target's final hidden state.

The kind's files: ``module.py`` (dims and heads), ``formats.py`` (vLLM's MedusaModel layout, written
and read; the original FasterDecoding layout, read), ``objective.py`` (training side) and
``decode.py`` (inference side), the last two named here by import path only.
"""

from selfdraft.heads.kinds.medusa.config import MedusaConfig
from selfdraft.heads.kinds.medusa.formats import READERS, WRITERS
from selfdraft.heads.kinds.medusa.module import MedusaDims, MedusaHeads
from selfdraft.heads.registry import DrafterKind

KIND = DrafterKind(
    name="medusa",
    title="Medusa",
    dims=MedusaDims,
    build=MedusaHeads.from_dims,
    feature_layers=lambda config, num_layers: [num_layers],
    objective="selfdraft.heads.kinds.medusa.objective:MedusaObjective",
    adapter="selfdraft.heads.kinds.medusa.decode:adapter",
    section=("medusa", MedusaConfig),
    default=True,
    writers=WRITERS,
    readers=READERS,
    tree_options=("max_nodes",),
    trains_target=lambda config: ("Medusa-2 trains the target (LoRA adapters on it)"
                                  if config.drafter.medusa.lora.rank > 0 else None),
)

KINDS = (KIND,)
"""The kinds this folder registers (``selfdraft.heads.kinds`` finds the folder)."""
ORDER = 0
"""Where these kinds come among the registered ones (lists, messages): folders register by ORDER."""
