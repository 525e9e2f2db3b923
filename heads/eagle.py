"""EAGLE feature drafters, weights and forward only: EAGLE-1 (kind ``eagle``) and EAGLE-3 (``eagle3``).

Both run one decoder layer over pairs (feature at position t, embedding of token t+1) and predict
what comes next. The layer is a Llama decoder layer configured like the target (``layer="llama"``, the
default: serving engines build every EAGLE draft layer as a Llama layer, whatever the target's
family, so a Qwen2 target's drafter has no q/k/v biases and a Qwen3 target's no q/k norms), or the
target's own family's layer class (``layer="target"``: decodes here, but engines cannot load it).

* EAGLE-1: ``x = fc(cat(embed(token_{t+1}), f_t))`` with fc [H, 2H] (with a bias only where an
  imported SGLang / reference drafter has one: ``fc_bias``), then the decoder layer without its input
  norm; the output is the predicted feature f_{t+1}, and the logits are the target's LM head applied
  to it. f is the target's final normed hidden state (what its LM head reads).
* EAGLE-3: the feature is ``g_t = fc(cat(h_low, h_mid, h_high))`` with fc [H, 3H] over three target
  layers (step 0), or the drafter's own previous output (later steps). The attention reads
  ``cat(input_layernorm(embed(token_{t+1})), hidden_norm(g_t))`` [2H] and the residual stream is g_t.
  Logits come from its own ``lm_head(norm(out))`` over a reduced draft vocabulary of V' tokens: draft id
  i is target id ``i + d2t[i]``; ``t2d[v]`` says whether target token v is in the draft vocabulary.

The token embedding is the target's (passed in, never trained here). Shapes: B batch, T positions,
S cached + new positions, H hidden, V' draft vocabulary.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch
from torch import nn

KINDS = ("eagle", "eagle3")
LAYERS = ("llama", "target")

# Fields of the target's text config that a Llama draft layer takes over unchanged.
_LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "bos_token_id",
                 "eos_token_id", "pad_token_id")


def llama_layer_config(text_config) -> dict[str, Any]:
    """A one-layer Llama config shaped like ``text_config`` (any family): the same hidden, MLP and
    attention sizes, head dim, activation, norm epsilon and RoPE, with no biases, no q/k norms and
    untied embeddings. This is the layer vLLM and SGLang build for an EAGLE drafter."""
    from transformers import LlamaConfig

    values = {k: getattr(text_config, k) for k in _LLAMA_FIELDS if getattr(text_config, k, None) is not None}
    values["head_dim"] = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    config = LlamaConfig(**values, num_hidden_layers=1, attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
    out = config.to_dict()
    for volatile in ("architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path"):
        out.pop(volatile, None)
    return out


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's three feature layers in vLLM's and SGLang's default convention: (2, L // 2, L - 3),
    counted as transformers' ``hidden_states`` index (the input of that decoder layer)."""
    return [2, num_layers // 2, num_layers - 3]


def _layer_class(text_config) -> type[nn.Module]:
    """The decoder layer class of the target's family, from transformers' own modeling module."""
    model_type = text_config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    for name in dir(module):
        if name.endswith("DecoderLayer") and not name.startswith("_"):
            cls = getattr(module, name)
            if isinstance(cls, type) and issubclass(cls, nn.Module):
                return cls
    raise ValueError(f"transformers has no decoder layer class for model type {model_type!r}")


def _rotary_class(text_config) -> type[nn.Module]:
    model_type = text_config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    for name in dir(module):
        if name.endswith("RotaryEmbedding") and not name.startswith("_"):
            return getattr(module, name)
    raise ValueError(f"transformers has no rotary embedding class for model type {model_type!r}")


class EagleDrafter(nn.Module):
    """One EAGLE drafter; see the module docstring. Build it with :meth:`for_target` or from ``dims``."""

    def __init__(self, dims: dict[str, Any]):
        super().__init__()
        from transformers import AutoConfig

        kind = dims["kind"]
        self.dims = copy.deepcopy(dims)
        if kind not in KINDS:
            raise ValueError(f"EAGLE kind must be one of {KINDS}, got {kind!r}")
        cfg = AutoConfig.for_model(**copy.deepcopy(dims["layer_config"]))
        cfg.num_hidden_layers = 1
        cfg._attn_implementation = "sdpa"
        H = cfg.hidden_size
        self.kind, self.hidden_size, self.vocab_size = kind, H, dims["vocab_size"]
        self.layer_config = cfg
        layer = _layer_class(cfg)(cfg, layer_idx=0)
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer, name):
                raise ValueError(f"{type(layer).__name__} has no {name}: EAGLE drafters need a Llama-like layer")
        self.rotary = _rotary_class(cfg)(config=cfg)
        if kind == "eagle":
            self.fc = nn.Linear(2 * H, H, bias=bool(dims.get("fc_bias", False)))
            layer.input_layernorm = nn.Identity()  # the fused input is not normalised (EAGLE-1 / vLLM layout)
            self.layer = layer
        else:
            self.aux_layers = list(dims["aux_layers"])
            self.fc = nn.Linear(len(self.aux_layers) * H, H, bias=False)
            attn = layer.self_attn
            for proj in ("q_proj", "k_proj", "v_proj"):  # the attention reads [embedding; feature]: 2H
                old = getattr(attn, proj)
                setattr(attn, proj, nn.Linear(2 * H, old.out_features, bias=old.bias is not None))
            self.hidden_norm = copy.deepcopy(layer.input_layernorm)
            self.layer = layer
            self.norm = copy.deepcopy(layer.input_layernorm)
            self.draft_vocab_size = dims["draft_vocab_size"]
            self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False)
            # Draft id i -> target id i + d2t[i]; t2d[v]: target token v has a draft id.
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))

    @staticmethod
    def dims_for(target_model, kind: str, draft_vocab_size: int | None = None,
                 aux_layers: list[int] | None = None, layer: str = "llama", fc_bias: bool = False) -> dict[str, Any]:
        """Constructor dims of a drafter for ``target_model``: ``layer`` ``llama`` (what engines load)
        or ``target`` (the target family's own layer class); ``fc_bias`` only for EAGLE-1 imports."""
        if layer not in LAYERS:
            raise ValueError(f"EAGLE draft layer must be one of {LAYERS}, got {layer!r}")
        text = target_model.config.get_text_config()
        if layer == "llama":
            layer_config = llama_layer_config(text)
        else:
            layer_config = text.to_dict()
            for volatile in ("architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path"):
                layer_config.pop(volatile, None)
        dims: dict[str, Any] = {"kind": kind, "vocab_size": int(text.vocab_size), "layer_config": layer_config}
        if fc_bias:
            if kind != "eagle":
                raise ValueError("only EAGLE-1 drafters have an fc bias")
            dims["fc_bias"] = True
        if kind == "eagle3":
            dims["aux_layers"] = aux_layers or default_aux_layers(text.num_hidden_layers)
            dims["draft_vocab_size"] = int(draft_vocab_size or text.vocab_size)
        return dims

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """EAGLE-3: set d2t/t2d from the target ids of the draft vocabulary (V',), in draft-id order."""
        ids = draft_to_target.long()
        if ids.shape != (self.draft_vocab_size,) or len(set(ids.tolist())) != len(ids):
            raise ValueError(f"need {self.draft_vocab_size} distinct target ids, got shape {tuple(ids.shape)}")
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self) -> torch.Tensor:
        """(V',) target id of every draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: (..., 3H) concatenated target layers -> (..., H) feature."""
        return self.fc(aux)

    def forward(self, feature: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """feature (B, T, H), embeds (B, T, H) of the next tokens, position_ids (B, T), attention_mask
        (B, 1, T, S) additive float or None (causal), cache: a transformers Cache for this layer or
        None. Returns the output feature (B, T, H) (pre-norm in EAGLE-3)."""
        position_embeddings = self.rotary(feature, position_ids)
        if self.kind == "eagle":
            x = self.fc(torch.cat([embeds, feature], dim=-1))  # (B, T, H)
            return self.layer(x, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                              use_cache=cache is not None, position_embeddings=position_embeddings)
        layer = self.layer
        x = torch.cat([layer.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)  # (B, T, 2H)
        attn, _ = layer.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, cache=cache, position_ids=position_ids)
        h = feature + attn
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """EAGLE-1: target vocabulary logits through the target's LM head (..., V);
        EAGLE-3: draft vocabulary logits (..., V')."""
        if self.kind == "eagle":
            if lm_head is None:
                raise ValueError("EAGLE-1 drafts through the target's LM head: pass it as lm_head")
            return lm_head(out)
        return self.lm_head(self.norm(out))
