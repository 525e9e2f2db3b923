"""The block drafters: DFlash (kind ``dflash``) and DSpark (kind ``dspark``), a whole block of tokens per
drafter forward, verified as a chain (or, asked for, a tree that branches where the drafter is unsure).
One folder for both, since DSpark is DFlash's backbone with a Markov head and a confidence head:

* ``module.py``: the dims and the drafter module (weights and forward) of both kinds;
* ``layouts.py``: the engine layouts (vLLM, speculators), written and read;
* ``objective.py``: the training side (imported by the training loop only, by the path below);
* ``decode.py``: the inference side (imported by the decoder only, by the path below).
"""

from selfdraft.heads.kinds.block.config import BlockConfig
from selfdraft.heads.kinds.block.layouts import reader, writers
from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims, feature_layers
from selfdraft.heads.registry import DrafterKind


def _kind(name: str, title: str, dims: type, objective: str) -> DrafterKind:
    """The two kinds differ in their dims and objective; module, layouts and decoding are shared."""
    return DrafterKind(name=name, title=title, dims=dims, build=BlockHead, feature_layers=feature_layers,
                       objective=f"selfdraft.heads.kinds.block.objective:{objective}",
                       adapter="selfdraft.heads.kinds.block.decode:adapter", section=("block", BlockConfig),
                       writers=writers(), readers=(reader(name),))


DFLASH = _kind("dflash", "DFlash", DFlashDims, "BlockObjective")
DSPARK = _kind("dspark", "DSpark", DSparkDims, "DSparkObjective")

KINDS = (DFLASH, DSPARK)
"""The kinds this folder registers (``selfdraft.heads.kinds`` finds the folder)."""
ORDER = 2
"""Where these kinds come among the registered ones (lists, messages): folders register by ORDER."""
