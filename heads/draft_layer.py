"""The one decoder layer of a feature drafter (EAGLE-1, EAGLE-3), built from transformers' own classes.

Serving engines build every EAGLE draft layer as a Llama layer shaped like the target, whatever the
target's family (no q/k/v biases, no q/k norms): :func:`llama_layer_config`. A drafter may instead
use the target family's own layer (:func:`target_layer_config`); it then decodes here, but engines
cannot load it. :func:`layer_classes` finds the decoder-layer class the family's base model declares,
rather than scanning a module for a name.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from selfdraft.errors import SelfdraftError

LAYERS = ("llama", "target")
"""``drafter.eagle.layer``: a Llama layer (what engines load) or the target family's own."""

# Fields of the target's text config that a Llama draft layer takes over unchanged.
_LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "bos_token_id",
                 "eos_token_id", "pad_token_id")
VOLATILE = ("architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path")
"""Config fields that say where a config came from, not what it builds: never stored in dims."""


def llama_layer_config(text_config) -> dict[str, Any]:
    """A one-layer Llama config shaped like ``text_config`` (any family): the same hidden, MLP and
    attention sizes, head dim, activation, norm epsilon and RoPE, with no biases, no q/k norms and
    untied embeddings. This is the layer vLLM and SGLang build for an EAGLE drafter."""
    from transformers import LlamaConfig

    values = {k: getattr(text_config, k) for k in _LLAMA_FIELDS if getattr(text_config, k, None) is not None}
    values["head_dim"] = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    config = LlamaConfig(**values, num_hidden_layers=1, attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
    out = config.to_dict()
    for volatile in VOLATILE:
        out.pop(volatile, None)
    return out


def target_layer_config(text_config) -> dict[str, Any]:
    """The target family's own config, for a draft layer of its own class (``layer: target``)."""
    out = text_config.to_dict()
    for volatile in VOLATILE:
        out.pop(volatile, None)
    return out


def layer_config(text_config, layer: str) -> dict[str, Any]:
    if layer not in LAYERS:
        raise SelfdraftError(f"the draft layer must be one of {', '.join(LAYERS)}, got {layer!r}")
    return llama_layer_config(text_config) if layer == "llama" else target_layer_config(text_config)


def layer_classes(config) -> tuple[type[nn.Module], type[nn.Module]]:
    """(decoder layer class, rotary embedding class) of ``config``'s family: the layer class its base
    model declares as its unit (``_no_split_modules``), and the rotary embedding of the same modeling
    module. Nothing is instantiated, so this also works inside DeepSpeed's ``zero.Init``."""
    import sys

    from transformers import MODEL_MAPPING

    try:
        model_class = MODEL_MAPPING[type(config)]
    except KeyError:
        raise SelfdraftError(f"transformers has no base model for a {config.model_type} config: use drafter.eagle.layer=llama") from None
    module = sys.modules[model_class.__module__]
    names = list(getattr(model_class, "_no_split_modules", None) or [])
    layer_class = next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), type)), None)
    prefix = layer_class.__name__.removesuffix("DecoderLayer") if layer_class is not None else ""
    rotary_class = getattr(module, f"{prefix}RotaryEmbedding", None) if prefix else None
    if layer_class is None or rotary_class is None:
        raise SelfdraftError(f"{model_class.__name__} declares no decoder layer class with a rotary embedding beside it "
                             f"(units {names}): use drafter.eagle.layer=llama")
    return layer_class, rotary_class


def build_layer(layer_config: dict[str, Any]) -> tuple[Any, nn.Module, nn.Module]:
    """(config, one decoder layer, its rotary embedding) from a stored layer config."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**copy.deepcopy(layer_config))
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = "sdpa"
    layer_class, rotary_class = layer_classes(cfg)
    layer = layer_class(cfg, layer_idx=0)
    for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        if not hasattr(layer, name):
            raise SelfdraftError(f"{type(layer).__name__} has no {name}: feature drafters need a Llama-like layer "
                                 "(use drafter.eagle.layer=llama)")
    return cfg, layer, rotary_class(config=cfg)


class FeatureHead(nn.Module):
    """What the modules of the EAGLE kinds share: their dims, one decoder layer built from the stored
    layer config, and its rotary embedding."""

    def _begin(self, dims) -> nn.Module:
        """Set the dims, sizes and rotary embedding; return the new decoder layer for the subclass to
        adapt and register (registered by the caller, so its weights draw from the RNG in their order)."""
        self.dims = dims
        cfg, layer, rotary = build_layer(dims.layer_config)
        self.hidden_size, self.vocab_size, self.layer_config = cfg.hidden_size, dims.vocab_size, cfg
        self.rotary = rotary
        return layer
