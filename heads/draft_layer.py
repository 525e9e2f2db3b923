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

import torch
from torch import nn

from selfdraft.errors import SelfdraftError

LAYERS = ("llama", "target")
"""``drafter.eagle.layer``: a Llama layer (what engines load) or the target family's own."""

# Fields of the target's text config that a Llama draft layer takes over unchanged.
_LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
VOLATILE = ("architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path")
"""Config fields that say where a config came from, not what it builds: never stored in dims."""
_EPS_FIELDS = ("rms_norm_eps", "norm_eps", "norm_epsilon", "rms_norm_epsilon", "layer_norm_eps", "layer_norm_epsilon")
"""Where families keep their norm epsilon (Llama: rms_norm_eps; LFM2: norm_eps; StarCoder2: norm_epsilon; ...)."""


def norm_eps(text_config, default: float = 1e-6) -> float:
    """The target's norm epsilon, whatever its family calls it (``default`` where it names none)."""
    for name in _EPS_FIELDS:
        value = getattr(text_config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return default


def rope_parameters(text_config) -> dict[str, Any]:
    """One RoPE setting for a draft layer shaped like ``text_config``: transformers 5's ``rope_parameters``
    (else a legacy ``rope_theta``). A family that keeps one setting per layer type (Gemma 3: local and
    global layers, ``{"sliding_attention": {...}, "full_attention": {...}}``) gives its full-attention
    layers' one, since a draft layer attends over its whole context; ``partial_rotary_factor`` is dropped,
    as transformers' Llama layer rotates every head dimension whatever it says (vLLM's would read it and
    rotate a part: the draft layer would be served with another RoPE than it was trained with)."""
    rope = getattr(text_config, "rope_parameters", None)
    rope = dict(rope) if isinstance(rope, dict) else {}
    nested = {k: v for k, v in rope.items() if isinstance(v, dict)}
    if nested:  # keyed by layer type
        types = list(getattr(text_config, "layer_types", None) or [])
        key = "full_attention" if "full_attention" in nested else next((t for t in types if t in nested), next(iter(nested)))
        rope = dict(nested[key])
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(getattr(text_config, "rope_theta", None) or 10000.0)
    rope.setdefault("rope_type", "default")
    rope.pop("partial_rotary_factor", None)
    return rope


def llama_layer_config(text_config) -> dict[str, Any]:
    """A one-layer Llama config shaped like ``text_config`` (any family): the same hidden, MLP and
    attention sizes, head dim, norm epsilon and RoPE (:func:`rope_parameters`), with SiLU, no biases, no
    q/k norms and untied embeddings. This is the layer vLLM and SGLang build for an EAGLE drafter (their
    Llama MLP takes SiLU only), whatever the target's own activation, attention (windows, sinks,
    soft-capping, latent attention) or MLP (experts) is: the draft layer is the drafter's own."""
    from transformers import LlamaConfig

    values = {k: getattr(text_config, k) for k in _LLAMA_FIELDS if getattr(text_config, k, None) is not None}
    values["intermediate_size"] = int(getattr(text_config, "intermediate_size", None)
                                      or getattr(text_config, "moe_intermediate_size", None) or 4 * text_config.hidden_size)
    values["head_dim"] = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    config = LlamaConfig(**values, hidden_act="silu", rms_norm_eps=norm_eps(text_config),
                         rope_parameters=rope_parameters(text_config), num_hidden_layers=1, attention_bias=False,
                         mlp_bias=False, tie_word_embeddings=False)
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


def _one_full_attention_layer(cfg) -> None:
    """Make ``cfg`` (a target family's config, in place) describe one full-attention layer: a draft layer
    attends over its whole context (the training masks and the decoder's cache assume it), so a family
    whose layer 0 is a sliding-window, chunked, linear-attention or convolution layer gets its full
    attention layer instead (``layer_types``), and a window that applies to every layer is lifted."""
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"]
    else:
        for name in ("sliding_window", "attention_chunk_size"):
            if getattr(cfg, name, None) is not None:
                setattr(cfg, name, None)
    if getattr(cfg, "use_sliding_window", None):
        cfg.use_sliding_window = False


_SELF_INITIALISED = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.LayerNorm, nn.GroupNorm)


def _initialise(layer: nn.Module, cfg) -> None:
    """Initialise the parameters a family's modules create with ``torch.empty`` and leave to its
    ``PreTrainedModel._init_weights`` (experts, routers, attention sinks: GPT-OSS, Qwen3-MoE), which a
    decoder layer built alone never gets: each module that holds parameters of its own, other than torch's
    layers (which initialise themselves, and keep their init), goes through the family's ``_init_weights``
    (norms come out as their constructors made them: a Llama layer's init is unchanged). Parameters that
    DeepSpeed's ZeRO-3 has already partitioned are left to it."""
    from transformers import MODEL_MAPPING

    owners = [m for m in layer.modules()
              if not isinstance(m, _SELF_INITIALISED) and any(True for _ in m.parameters(recurse=False))]
    if not owners or any(hasattr(p, "ds_id") for m in owners for p in m.parameters(recurse=False)):
        return
    model_class = MODEL_MAPPING[type(cfg)]
    family = model_class.__new__(model_class)  # only for its _init_weights, which reads self.config
    nn.Module.__init__(family)
    family.config = cfg
    with torch.no_grad():
        for module in owners:
            family._init_weights(module)


class _LayerTypeRotary(nn.Module):
    """A rotary embedding that keeps one setting per layer type (Gemma 3's ``forward(x, position_ids,
    layer_type)``), called as the others are, with the full-attention setting."""

    def __init__(self, rotary: nn.Module, layer_type: str):
        super().__init__()
        self.rotary, self.layer_type = rotary, layer_type

    def forward(self, x, position_ids):
        return self.rotary(x, position_ids, layer_type=self.layer_type)


def build_layer(layer_config: dict[str, Any]) -> tuple[Any, nn.Module, nn.Module]:
    """(config, one decoder layer, its rotary embedding) from a stored layer config.

    The layer is always a full-attention one (:func:`_one_full_attention_layer`), with sdpa where its
    family has it, else eager (soft-capping, attention sinks:
    :func:`~selfdraft.heads.target_layers.attention_backend`); :meth:`FeatureHead.causal` then gives it
    explicit causal masks where the caller passes none."""
    import inspect

    from transformers import AutoConfig

    from selfdraft.heads.target_layers import attention_backend

    cfg = AutoConfig.for_model(**copy.deepcopy(layer_config))
    cfg.num_hidden_layers = 1
    _one_full_attention_layer(cfg)
    cfg._attn_implementation = attention_backend(cfg)
    layer_class, rotary_class = layer_classes(cfg)
    layer = layer_class(cfg, layer_idx=0)
    for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        if not hasattr(layer, name):
            raise SelfdraftError(f"{type(layer).__name__} has no {name}: feature drafters need a Llama-like layer "
                                 "(use drafter.eagle.layer=llama)")
    _initialise(layer, cfg)
    rotary = rotary_class(config=cfg)
    if "layer_type" in inspect.signature(rotary_class.forward).parameters:
        rotary = _LayerTypeRotary(rotary, "full_attention")
    return cfg, layer, rotary


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

    def causal(self, attention_mask, x, cache=None):
        """``attention_mask`` as the layer's attention takes it: None (sdpa's own causal mask) stays None
        under sdpa; an eager layer, which applies no mask of its own, gets the causal one of x's T new
        positions after the cache's (B, 1, T, past + T)."""
        if attention_mask is not None or self.layer_config._attn_implementation == "sdpa":
            return attention_mask
        T = x.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        keys = torch.arange(past + T, device=x.device)
        visible = keys[None, :] <= (past + torch.arange(T, device=x.device))[:, None]  # (T, past + T)
        from selfdraft.heads.target_layers import additive_mask

        return additive_mask(visible, x.dtype).expand(x.shape[0], -1, -1, -1)

    @staticmethod
    def mlp(layer, x):
        """The layer's MLP on x; a mixture-of-experts block that also returns its router's scores gives the
        output alone."""
        out = layer.mlp(x)
        return out[0] if isinstance(out, tuple) else out
