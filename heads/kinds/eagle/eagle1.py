"""EAGLE-1's drafter, weights and forward only.

One decoder layer runs over pairs (feature f_t, embedding of token t+1):
``x = fc(cat(embed(token_{t+1}), f_t))`` with fc [H, 2H] (a bias only where an imported SGLang or
reference drafter has one: ``fc_bias``), then the decoder layer without its input norm; the output
is the predicted feature f_{t+1}, and its logits are the target's LM head applied to it. f is the
target's final normed hidden state (what its LM head reads). The token embedding and the LM head are
the target's (passed in, never trained here). Shapes: B batch, T positions, S cached + new
positions, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from selfdraft.errors import SelfdraftError
from selfdraft.heads.draft_layer import FeatureHead, layer_config
from selfdraft.heads.registry import Dims


@dataclass(frozen=True)
class Eagle1Dims(Dims):
    KIND_FIELD = "eagle"  # stored in config.json dims, as EAGLE folders always have

    vocab_size: int
    layer_config: dict[str, Any]
    """The draft layer's transformers config (a one-layer Llama config unless trained with the target's own class)."""
    fc_bias: bool = False
    """fc has a bias (EAGLE-1 drafters imported from SGLang or the reference code)."""

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if not self.fc_bias:  # folders without one never stored the field
            out.pop("fc_bias")
        return out

    @classmethod
    def for_target(cls, target_model, layer: str = "llama", fc_bias: bool = False) -> "Eagle1Dims":
        text = target_model.config.get_text_config()
        return cls(vocab_size=int(text.vocab_size), layer_config=layer_config(text, layer), fc_bias=fc_bias)


class Eagle1Head(FeatureHead):
    """The EAGLE-1 drafter module (weights and forward); see the module docstring."""

    def __init__(self, dims: Eagle1Dims):
        super().__init__()
        layer = self._begin(dims)
        H = self.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=dims.fc_bias)
        layer.input_layernorm = nn.Identity()  # the fused input is not normalised (EAGLE-1 / vLLM layout)
        self.layer = layer

    def forward(self, feature: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """feature (B, T, H), embeds (B, T, H) of the next tokens, position_ids (B, T), attention_mask
        (B, 1, T, S) additive float or None (causal), cache: a transformers Cache for this layer or
        None. Returns the predicted next feature (B, T, H)."""
        position_embeddings = self.rotary(feature, position_ids)
        x = self.fc(torch.cat([embeds, feature], dim=-1))  # (B, T, H)
        return self.layer(x, attention_mask=self.causal(attention_mask, x, cache), position_ids=position_ids, cache=cache,
                          use_cache=cache is not None, position_embeddings=position_embeddings)

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target ``hidden_states`` it reads in decoding: the final normed state."""
        return (num_layers,)

    def features(self, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Target hidden states (one (m, H) per :meth:`target_layers` entry) -> input features (m, H)."""
        return hidden[0]

    def token_map(self) -> torch.Tensor | None:
        """(V',) target id of every draft id; None: it drafts over the target's own vocabulary."""
        return None

    def logits(self, out: torch.Tensor, lm_head: nn.Module | None) -> torch.Tensor:
        """Target-vocabulary logits (..., V) through the target's LM head."""
        if lm_head is None:
            raise SelfdraftError("EAGLE-1 drafts through the target's LM head: pass it as lm_head")
        return lm_head(out)
