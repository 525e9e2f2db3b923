"""EAGLE-3's drafter, weights and forward only.

The feature is ``g_t = fc(cat(h_a, h_b, h_c))`` with fc [H, 3H] over three target layers (step 0),
or the drafter's own previous output (later steps). The attention reads
``cat(input_layernorm(embed(token_{t+1})), hidden_norm(g_t))`` [2H] and the residual stream is g_t.
Logits come from its own ``lm_head(norm(out))`` over a reduced draft vocabulary of V' tokens: draft id
i is target id ``i + d2t[i]``; ``t2d[v]`` says whether target token v is in the draft vocabulary. The
token embedding is the target's (passed in, never trained here). Shapes: B batch, T positions, S
cached + new positions, H hidden, V' draft vocabulary.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from selfdraft.errors import SelfdraftError
from selfdraft.heads.draft_layer import FeatureHead, layer_config
from selfdraft.heads.registry import Dims


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's three feature layers in vLLM's and SGLang's default convention: (2, L // 2, L - 3),
    counted as transformers' ``hidden_states`` index (the input of that decoder layer)."""
    return [2, num_layers // 2, num_layers - 3]


def feature_layers(aux_layers: list[int], num_layers: int) -> list[int]:
    """The ``hidden_states`` indices EAGLE-3 trains on: its aux layers (negative ones counted from the
    end; none: the engines' default), then the final normed state (index ``num_layers``)."""
    aux = [i + num_layers + 1 if i < 0 else i for i in (list(aux_layers) or default_aux_layers(num_layers))]
    if not all(0 <= i <= num_layers for i in aux):
        raise SelfdraftError(f"EAGLE-3 aux layers {aux} out of range for a target with {num_layers} layers: give "
                             f"hidden_states indices 0..{num_layers} in drafter.eagle.aux_layers")
    return [*aux, num_layers]


@dataclass(frozen=True)
class Eagle3Dims(Dims):
    KIND_FIELD = "eagle3"

    vocab_size: int
    layer_config: dict[str, Any]
    """The draft layer's transformers config (a one-layer Llama config unless trained with the target's own class)."""
    aux_layers: list[int]
    """The fused target layers, as transformers ``hidden_states`` indices."""
    draft_vocab_size: int

    @classmethod
    def for_target(cls, target_model, draft_vocab_size: int | None = None, aux_layers: list[int] | None = None,
                   layer: str = "llama") -> "Eagle3Dims":
        text = target_model.config.get_text_config()
        return cls(vocab_size=int(text.vocab_size), layer_config=layer_config(text, layer),
                   aux_layers=list(aux_layers or default_aux_layers(text.num_hidden_layers)),
                   draft_vocab_size=int(draft_vocab_size or text.vocab_size))


class Eagle3Head(FeatureHead):
    """The EAGLE-3 drafter module (weights and forward); see the module docstring."""

    def __init__(self, dims: Eagle3Dims):
        super().__init__()
        layer = self._begin(dims)
        H = self.hidden_size
        self.aux_layers = list(dims.aux_layers)
        self.fc = nn.Linear(len(self.aux_layers) * H, H, bias=False)
        attn = layer.self_attn
        missing = [p for p in ("q_proj", "k_proj", "v_proj") if not isinstance(getattr(attn, p, None), nn.Linear)]
        if missing:  # latent attention (DeepSeek's MLA) projects through low-rank factors instead
            raise SelfdraftError(f"{type(attn).__name__} has no {', '.join(missing)} projection: EAGLE-3's attention reads "
                                 "[embedding; feature] through q/k/v projections of 2H inputs (use drafter.eagle.layer=llama)")
        for proj in ("q_proj", "k_proj", "v_proj"):  # the attention reads [embedding; feature]: 2H
            old = getattr(attn, proj)
            setattr(attn, proj, nn.Linear(2 * H, old.out_features, bias=old.bias is not None))
        self.hidden_norm = copy.deepcopy(layer.input_layernorm)
        self.layer = layer
        self.norm = copy.deepcopy(layer.input_layernorm)
        self.draft_vocab_size = dims.draft_vocab_size
        self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False)
        # Draft id i -> target id i + d2t[i]; t2d[v]: target token v has a draft id.
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Set d2t/t2d from the target ids of the draft vocabulary (V',), in draft-id order."""
        ids = draft_to_target.long()
        if ids.shape != (self.draft_vocab_size,) or len(set(ids.tolist())) != len(ids):
            raise SelfdraftError(f"a draft vocabulary needs {self.draft_vocab_size} distinct target ids, "
                                 f"got shape {tuple(ids.shape)}")
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self) -> torch.Tensor:
        """(V',) target id of every draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """(..., 3H) concatenated target layers -> (..., H) feature."""
        return self.fc(aux)

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target ``hidden_states`` it reads in decoding: its aux layers."""
        return tuple(self.aux_layers)

    def features(self, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Target hidden states (one (m, H) per aux layer) -> input features (m, H)."""
        return self.fuse(torch.cat(hidden, dim=-1))

    def token_map(self) -> torch.Tensor:
        return self.draft_to_target()

    def forward(self, feature: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """feature (B, T, H), embeds (B, T, H) of the next tokens, position_ids (B, T), attention_mask
        (B, 1, T, S) additive float or None (causal), cache: a transformers Cache for this layer or
        None. Returns the output feature (B, T, H), before the final norm."""
        position_embeddings = self.rotary(feature, position_ids)
        layer = self.layer
        x = torch.cat([layer.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)  # (B, T, 2H)
        attn, _ = layer.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                  attention_mask=self.causal(attention_mask, x, cache), cache=cache,
                                  position_ids=position_ids)
        h = feature + attn
        return h + self.mlp(layer, layer.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Draft-vocabulary logits (..., V')."""
        return self.lm_head(self.norm(out))
