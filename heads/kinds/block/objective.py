"""The DFlash and DSpark training objectives (the training side of the block kinds: imported by the
training loop only).

Per sequence, ``drafter.block.anchors`` anchors are drawn among the positions whose next token is
supervised (an assistant token of the same conversation). The block of anchor a is the token x_a
followed by mask tokens at positions a, a+1, ...; it reads the fused target context at positions
before a (the target has not read x_a at decoding time) and attends to its own slots both ways.
Drafted token j (0-based) of the block is x_{a+1+j}: DFlash reads it at slot j+1, DSpark at slot j.
It is scored where x_{a+1+j} and every drafted token before it are supervised (a verified chain stops
at the first miss), against the target's own distribution for x_{a+1+j} (its final normed state at
a+j through its LM head): KL over the draft vocabulary, as EAGLE-3, weighted exp(-j / gamma).

DSpark adds its Markov head, trained with the true previous token (teacher forcing), as a term of
the logits (``markov_w2(markov_w1[x_{a+j}])``), and its confidence head: binary cross-entropy of the
slot's acceptance logit against the probability that the target accepts the drafter's token there,
sum over v of min(p_target(v), q_draft(v)) = 1 - total variation (detached).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F

from selfdraft.configs.run import RunConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds import get_kind
from selfdraft.heads.kinds.block.module import BlockDims, BlockHead, DFlashDims, DSparkDims
from selfdraft.train.features import target_features
from selfdraft.train.objectives import (LOSS_CHUNK_ELEMENTS, DrafterObjective, Group, Teacher, as_linear, depth_stats,
                                        draft_vocabulary, gathered, head_losses, segments_of, subtree, unshard_units,
                                        zero_loss)
from selfdraft.train.profile import phase

EVAL_ANCHOR_SEED = 20261204
"""Held-out batches draw their anchors from this seed, so that every evaluation scores the same blocks."""


def choose_mask_token(text_config, train_data, configured: int | None) -> int:
    """The mask token: the configured one, which must not occur in the training data, else the largest
    id that is not the target's bos/eos/pad and never occurs there."""
    vocab = int(text_config.vocab_size)
    seen = torch.zeros(vocab, dtype=torch.bool)
    for ids, _ in train_data or ():
        seen[torch.as_tensor(ids, dtype=torch.long)] = True
    if configured is not None:
        if not 0 <= configured < vocab:
            raise SelfdraftError(f"drafter.block.mask_token_id {configured} is outside the target's vocabulary 0..{vocab - 1}")
        if seen[configured]:
            raise SelfdraftError(f"drafter.block.mask_token_id {configured} is a token of the training data: the drafter "
                                 "could not tell a mask from it; choose a token that never occurs (e.g. an unused special "
                                 "token of the tokenizer), or leave it unset to have one chosen")
        return int(configured)
    special = [getattr(text_config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    special = {int(i) for s in special if s is not None for i in (s if isinstance(s, (list, tuple)) else [s])}
    for candidate in range(vocab - 1, -1, -1):
        if candidate not in special and not seen[candidate]:
            return candidate
    raise SelfdraftError("every token of the vocabulary occurs in the training data: set drafter.block.mask_token_id")


class LinearView:
    """A projection given by tensors (``weight`` (V, D), ``bias``) for ``head_losses``: DSpark's LM head
    and Markov head as one product, [W ; W2] over [h ; markov_w1[previous]]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias, self.out_features = weight, bias, weight.shape[0]


@dataclasses.dataclass
class BlockPlan:
    """One batch's blocks (B rows, T positions, A anchors per row, K drafted tokens per block)."""

    features: torch.Tensor
    """(B, T, layers, H) the target's hidden states (the kind's feature layers, the final one last)."""
    positions: torch.Tensor
    """(B, T) each position within its conversation."""
    anchor: torch.Tensor
    """(B, A) the anchors' indices, ascending."""
    ok: torch.Tensor
    """(B, A, K) bool: drafted token j of the block is scored."""
    label_at: torch.Tensor
    """(B, A, K) the index of drafted token j's label x_{a+1+j} (clamped where not scored)."""
    visible: torch.Tensor
    """(B, A, T) bool: the context positions each block reads."""


class BlockObjective(DrafterObjective):
    """DFlash (and, with :class:`DSparkObjective`, DSpark): see the module docstring. Stats use "head
    j" for the j-th drafted token of a block."""

    DIMS: type[BlockDims] = DFlashDims
    budget_epochs = 8.0
    """A block drafter's step costs a fraction of the target's forward, and its held-out accuracy still
    rose after many epochs over one cache; in the 15-minute quickstart 8 epochs over a cache trained
    DFlash as well as 3 over one twice the size (by measurement: docs/results/block-drafters.md,
    docs/results/quickstart.md)."""
    budget_evidence = "trained DFlash as well as 3 in the quickstart, from half the cache"

    def __init__(self, run: RunConfig, target_model: nn.Module, train_data=None,
                 chunk_elements: int = LOSS_CHUNK_ELEMENTS):
        super().__init__()
        cfg = run.drafter.block
        self.config, self.top_k, self.chunk_elements = cfg, run.train.top_k, chunk_elements
        target_model.requires_grad_(False)
        self.target = target_model
        text = target_model.config.get_text_config()
        self.feature_layers = get_kind(run.drafter.kind).feature_layers(run, text.num_hidden_layers)
        if cfg.block_size > text.max_position_embeddings:
            raise SelfdraftError(f"drafter.block.block_size {cfg.block_size} exceeds the target's context of "
                                 f"{text.max_position_embeddings} positions")
        if train_data is None:
            raise SelfdraftError("a block drafter's objective needs the training data (its mask token and draft vocabulary)")
        draft_vocab = min(cfg.draft_vocab_size, int(text.vocab_size))
        dims = self.DIMS.shaped_like(text, **self._fields(cfg), draft_vocab_size=draft_vocab,
                                     mask_token_id=choose_mask_token(text, train_data, cfg.mask_token_id),
                                     target_layers=self.feature_layers[:-1])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(run.train.seed)
            self.drafter = BlockHead(dims).float()
        self.steps = dims.drafts_per_block
        self._start_from_target(target_model, train_data)

    def _fields(self, cfg) -> dict:
        return {"block_size": cfg.block_size, "num_layers": cfg.num_layers}

    def _start_from_target(self, target_model, train_data) -> None:
        """The final norm from the target's; with its own head, the draft vocabulary (the data's most
        frequent assistant tokens) and the target's rows for them."""
        drafter, text = self.drafter, target_model.config.get_text_config()
        final_norm = getattr(getattr(target_model.get_decoder(), "norm", None), "weight", None)
        head_weight = target_model.get_output_embeddings().weight
        ids = draft_vocabulary(train_data, text.vocab_size, drafter.draft_vocab_size) if drafter.own_head else None
        if ids is not None:
            drafter.set_vocab_map(ids)
        with torch.no_grad(), gathered([head_weight, final_norm]):
            if final_norm is not None and not final_norm.is_meta:
                drafter.norm.weight.copy_(final_norm.float())
            if ids is not None and not head_weight.is_meta:
                drafter.lm_head.weight.copy_(head_weight[ids].float())

    def drafter_module(self, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        if state is None:
            return self.drafter
        with torch.random.fork_rng(devices=[]):
            drafter = BlockHead(self.drafter.dims).float()
        drafter.load_state_dict(subtree(state, "drafter"))
        return drafter

    def decode_defaults(self, rank_accuracy: torch.Tensor | None) -> dict:
        """The chain of the block's drafted tokens, verified whole."""
        return {"tree": {"depth": self.steps}}

    def predicted_tau(self, rank_accuracy: torch.Tensor) -> float:
        """1 + the expected accepted tokens of a greedy chain, each position's held-out top-1 taken as
        independent of the others'."""
        survive, total = 1.0, 1.0
        for j in range(min(self.steps, rank_accuracy.shape[0])):
            survive *= float(rank_accuracy[j, 0])
            total += survive
        return total

    # --- the batch ----------------------------------------------------------------------------------

    def _anchors(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``anchors`` anchors per row among ``valid`` (B, T) bool, ascending: (index (B, A),
        keep (B, A) bool). Held out, from a fixed seed."""
        B, T = valid.shape
        A = max(1, min(self.config.anchors, int(valid.sum(-1).max())))
        if self.training:
            scores = torch.rand(B, T, device=valid.device)
        else:
            generator = torch.Generator(device=valid.device).manual_seed(EVAL_ANCHOR_SEED)
            scores = torch.rand(B, T, device=valid.device, generator=generator)
        scores = scores.masked_fill(~valid, -1.0)
        top = scores.topk(A, dim=-1)
        index, order = top.indices.sort(dim=-1)
        keep = top.values.gather(-1, order) >= 0
        return index, keep

    def plan(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
             features: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> "BlockPlan":
        """The batch's blocks: the target's features, the anchors, and which drafted tokens are scored."""
        if features is None:
            with phase("target forward"):
                features = target_features(self.target, input_ids, attention_mask, self.feature_layers, position_ids)
        K = self.steps
        B, T = input_ids.shape
        device = input_ids.device
        live = attention_mask.bool()
        supervised = loss_mask.bool() & live
        if position_ids is None:
            positions = torch.arange(T, device=device)[None].expand(B, T)
            segments = torch.zeros(B, T, dtype=torch.long, device=device)
        else:
            positions, segments = position_ids, segments_of(position_ids)
        # Drafted token j of anchor a is x_{a+1+j}: scored if it is supervised and in a's conversation.
        follows = torch.zeros(B, T, dtype=torch.bool, device=device)  # index a: x_{a+1} is supervised, same conversation
        follows[:, :-1] = supervised[:, 1:] & (segments[:, 1:] == segments[:, :-1])
        anchor, keep = self._anchors(follows & live)  # (B, A)
        rows = torch.arange(B, device=device)[:, None, None]
        j = torch.arange(K, device=device)
        label_at = (anchor[:, :, None] + 1 + j).clamp(max=T - 1)  # (B, A, K) index of x_{a+1+j}
        seg_anchor = segments.gather(1, anchor)  # (B, A)
        ok = keep[:, :, None] & (anchor[:, :, None] + 1 + j < T) & supervised[rows, label_at] \
            & (segments[rows, label_at] == seg_anchor[:, :, None])
        ok = ok.long().cumprod(-1).bool()  # a chain: only the supervised prefix of a block counts
        t = torch.arange(T, device=device)
        visible = (t[None, None, :] < anchor[:, :, None]) & (segments[:, None, :] == seg_anchor[:, :, None]) \
            & live[:, None, :]  # (B, A, T): the context before the anchor, in its conversation
        return BlockPlan(features, positions, anchor, ok, label_at, visible)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                features: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        plan = self.plan(input_ids, attention_mask, loss_mask, features, position_ids)
        lm_head = as_linear(self.target.get_output_embeddings(), "the target's LM head")
        unshard_units(self.drafter)
        drafter, K, S = self.drafter, self.steps, self.drafter.block_size
        first = 1 - drafter.draft_offset  # the slot of the first drafted token
        B = input_ids.shape[0]
        device, dtype = input_ids.device, next(drafter.parameters()).dtype
        R = 1 if self.training else max(1, self.top_k)
        anchor, A = plan.anchor, plan.anchor.shape[1]
        with phase("drafter forward"):
            context = drafter.fuse(plan.features[:, :, :-1].flatten(2).to(dtype))  # (B, T, H)
            kv = drafter.context_kv(context, plan.positions)
            block_ids = torch.full((B, A, S), drafter.mask_token_id, dtype=torch.long, device=device)
            block_ids[:, :, 0] = input_ids.gather(1, anchor)
            embeds = self.target.get_input_embeddings()(block_ids).detach().to(dtype)  # (B, A, S, H)
            block_positions = plan.positions.gather(1, anchor)[:, :, None] + torch.arange(S, device=device)  # (B, A, S)
            out = drafter(embeds, block_positions, kv, plan.visible)  # (B, A, S, H)
        loss = zero_loss(drafter)
        total, table = self._losses(out, plan.ok, plan.label_at, input_ids, plan.features, lm_head, first,
                                    0 if self.training else R)
        return loss + total, depth_stats(table, plan.ok.sum(dim=(0, 1)), K, R)

    # --- the losses ---------------------------------------------------------------------------------

    def _head(self, lm_head) -> nn.Module | LinearView:
        return self.drafter.head(lm_head)

    def _inputs(self, h: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """What the head projects for a slot: its state (DSpark: and the previous token's Markov embedding)."""
        return h

    def _losses(self, out, ok, label_at, input_ids, features, lm_head, first, ranks):
        drafter, cfg, K = self.drafter, self.config, self.steps
        B = input_ids.shape[0]
        rows = torch.arange(B, device=input_ids.device)[:, None, None]
        draft_ids = drafter.draft_to_target() if drafter.own_head else None
        to_draft = None
        if draft_ids is not None:  # the label: the target's argmax as a draft id (-1 outside the draft vocabulary)
            to_draft = torch.full((drafter.vocab_size,), -1, dtype=torch.long, device=input_ids.device)
            to_draft[draft_ids] = torch.arange(len(draft_ids), device=input_ids.device)
        head = self._head(lm_head)
        groups, teacher_states, start = [], [], 0
        previous_all = input_ids[rows, (label_at - 1)]  # (B, A, K): x_{a+j}, the token before drafted token j
        for j in range(K):
            sel = ok[:, :, j]
            h = out[:, :, first + j][sel]  # (M_j, H)
            x = self._inputs(h, previous_all[:, :, j][sel])
            m = len(h)
            groups.append(Group(x, head, torch.arange(start, start + m, device=h.device), math.exp(-j / cfg.loss_decay)))
            # The target's distribution for x_{a+1+j}: its final normed state at a+j.
            teacher_states.append(features[rows[:, :, 0], label_at[:, :, j] - 1, -1][sel])
            start += m
        teacher = Teacher(hidden=torch.cat(teacher_states), head=lm_head, columns=draft_ids, to_label=to_draft)
        trains_confidence = self._trains_confidence()
        with phase("losses"):
            total, table, *accept = head_losses(groups, teacher, top_k=self.top_k, ranks=ranks,
                                                chunk_elements=self.chunk_elements, overlap=trains_confidence)
        if trains_confidence:
            total = total + self._confidence_loss(groups, accept[0], previous_all, ok, out, first)
        return total, table

    def _trains_confidence(self) -> bool:
        return False


class DSparkObjective(BlockObjective):
    """DSpark: the block drafter with its Markov head (in the logits) and confidence head (its own loss)."""

    DIMS = DSparkDims

    def _fields(self, cfg) -> dict:
        return {**super()._fields(cfg), "markov_rank": cfg.markov_rank, "confidence_head": cfg.confidence_head}

    def _head(self, lm_head) -> LinearView:
        base = self.drafter.head(lm_head)
        markov = self.drafter.markov_head.markov_w2.weight  # (V', r)
        return LinearView(torch.cat([base.weight.to(markov.dtype), markov], dim=1))  # (V', H + r)

    def _inputs(self, h: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, self.drafter.markov_head.markov_w1(previous).to(h.dtype)], dim=-1)

    def _trains_confidence(self) -> bool:
        return self.drafter.confidence_head is not None

    def _confidence_loss(self, groups, accept, previous_all, ok, out, first) -> torch.Tensor:
        """The confidence head's loss: BCE of its logit at each scored slot against ``accept``, the
        probability that the target accepts a token drawn from the drafter's distribution there,
        sum_v min(p_target(v), q(v)) (from :func:`head_losses`, without gradient), weighted by position
        as the draft loss is."""
        losses, weights = [], []
        for j, group in enumerate(groups):
            sel = ok[:, :, j]
            logit = self.drafter.confidence(out[:, :, first + j][sel], previous_all[:, :, j][sel])  # (M_j,)
            bce = F.binary_cross_entropy_with_logits(logit, accept[j].to(logit.dtype), reduction="sum")
            losses.append(bce / max(1, len(logit)) * group.weight)
            weights.append(group.weight)
        return self.config.confidence_weight * torch.stack(losses).sum() / sum(weights)
