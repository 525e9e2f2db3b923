"""The block drafters: DFlash (kind ``dflash``) and DSpark (kind ``dspark``), a whole block of tokens per
drafter forward, verified as a chain. One folder for both, since DSpark is DFlash's backbone with a
Markov head and a confidence head:

* ``module.py``: the dims and the drafter module (weights and forward) of both kinds;
* ``layouts.py``: the engine layouts (vLLM, speculators), written and read;
* ``objective.py``: the training side (imported by the training loop only, by the path below);
* ``decode.py``: the inference side (imported by the decoder only, by the path below).
"""

from selfdraft.heads.kinds.block.layouts import reader, writers
from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims, feature_layers
from selfdraft.heads.registry import DrafterKind

DFLASH = DrafterKind(
    name="dflash",
    title="DFlash",
    dims=DFlashDims,
    build=BlockHead,
    feature_layers=feature_layers,
    objective="selfdraft.heads.kinds.block.objective:BlockObjective",
    adapter="selfdraft.heads.kinds.block.decode:adapter",
    writers=writers(),
    readers=(reader("dflash"),),
    tree_options=("depth",),
)

DSPARK = DrafterKind(
    name="dspark",
    title="DSpark",
    dims=DSparkDims,
    build=BlockHead,
    feature_layers=feature_layers,
    objective="selfdraft.heads.kinds.block.objective:DSparkObjective",
    adapter="selfdraft.heads.kinds.block.decode:adapter",
    writers=writers(),
    readers=(reader("dspark"),),
    tree_options=("depth",),
)
