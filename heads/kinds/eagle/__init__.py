"""The EAGLE family: EAGLE-1 (kind ``eagle``) and EAGLE-3 (kind ``eagle3``), decoded with EAGLE-2
dynamic trees. One folder for both, since they share their engine layouts and their decoding:

* ``eagle1.py``, ``eagle3.py``: each kind's dims and drafter module (weights and forward);
* ``layouts.py``: the engine layouts (vLLM, SGLang/SpecForge, the reference code), written and read;
* ``objective.py``: the training side (imported by the training loop only, by the path below);
* ``decode.py``: the inference side (imported by the decoder only, by the path below).
"""

from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.eagle import eagle3
from selfdraft.heads.kinds.eagle.config import EagleConfig
from selfdraft.heads.kinds.eagle.eagle1 import Eagle1Dims, Eagle1Head
from selfdraft.heads.kinds.eagle.eagle3 import Eagle3Dims, Eagle3Head
from selfdraft.heads.kinds.eagle.layouts import reader, writers
from selfdraft.heads.registry import DrafterKind

EAGLE1 = DrafterKind(
    name="eagle",
    title="EAGLE-1",
    dims=Eagle1Dims,
    build=Eagle1Head,
    feature_layers=lambda config, num_layers: [num_layers],
    objective="selfdraft.heads.kinds.eagle.objective:Eagle1Objective",
    adapter="selfdraft.heads.kinds.eagle.decode:adapter",
    section=("eagle", EagleConfig),
    writers=writers(),
    readers=(reader("eagle"),),
)

EAGLE3 = DrafterKind(
    name="eagle3",
    title="EAGLE-3",
    dims=Eagle3Dims,
    build=Eagle3Head,
    feature_layers=lambda config, num_layers: eagle3.feature_layers(config.drafter.eagle.aux_layers, num_layers),
    objective="selfdraft.heads.kinds.eagle.objective:Eagle3Objective",
    adapter="selfdraft.heads.kinds.eagle.decode:adapter",
    section=("eagle", EagleConfig),
    writers=writers(speculators=True),
    readers=(reader("eagle3"),),
)

KINDS = (EAGLE1, EAGLE3)
"""The kinds this folder registers (``selfdraft.heads.kinds`` finds the folder)."""
ORDER = 1
"""Where these kinds come among the registered ones (lists, messages): folders register by ORDER."""


def new_drafter(target_model, kind: str, draft_vocab_size: int | None = None, aux_layers: list[int] | None = None,
                layer: str = "llama", fc_bias: bool = False) -> Eagle1Head | Eagle3Head:
    """A freshly initialised EAGLE-1 (``kind="eagle"``) or EAGLE-3 (``"eagle3"``) drafter for
    ``target_model``: ``draft_vocab_size`` and ``aux_layers`` are EAGLE-3's, ``fc_bias`` EAGLE-1's."""
    if kind == EAGLE1.name:
        return Eagle1Head(Eagle1Dims.for_target(target_model, layer=layer, fc_bias=fc_bias))
    if kind == EAGLE3.name:
        return Eagle3Head(Eagle3Dims.for_target(target_model, draft_vocab_size, aux_layers, layer))
    raise SelfdraftError(f"{kind!r} is not an EAGLE kind: give {EAGLE1.name!r} or {EAGLE3.name!r}")
