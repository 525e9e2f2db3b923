"""The EAGLE-1 and EAGLE-3 training objectives (the training side of the kinds: imported by the
training loop only)."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.nn import functional as F

from selfdraft.configs.run import RunConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds import get_kind
from selfdraft.heads.kinds.eagle.eagle1 import Eagle1Dims, Eagle1Head
from selfdraft.heads.kinds.eagle.eagle3 import Eagle3Dims, Eagle3Head
from selfdraft.heads.sparse_tree import expected_acceptance
from selfdraft.train.features import target_features
from selfdraft.train.objectives import (LOSS_CHUNK_ELEMENTS, DrafterObjective, Group, Teacher, as_linear, depth_stats,
                                        draft_vocabulary, gathered, head_losses, segments_of, subtree, teacher_rows,
                                        unshard_units, zero_loss)
from selfdraft.train.profile import phase, recording

logger = logging.getLogger(__name__)


def ttt_mask(length: int, step: int, dtype: torch.dtype, device, segments: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE-3 training-time test attention at unrolled step j: (1, 1, L, (j+1) L) additive, or
    (B, 1, L, (j+1) L) for a packed batch (``segments`` (B, L): each position's conversation).

    Query t sees step-0 keys (true target features) at positions <= t - j, and the key of step i
    (1 <= i <= j, the drafter's own features) at position t - j + i: exactly what a depth-(j+1) tree
    node sees in decoding (the committed cache, then its ancestors, then itself). Packed, only keys of
    its own conversation; step 0 is then the block-diagonal causal mask. Every query sees at least
    its own step-j key, so no row of the softmax is empty."""
    t = torch.arange(length, device=device)[:, None]  # (L, 1)
    s = torch.arange(length, device=device)[None, :]  # (1, L)
    blocks = [s <= t - step] + [s == t - step + i for i in range(1, step + 1)]
    visible = torch.cat(blocks, dim=1)  # (L, (j+1) L)
    if segments is None:
        mask = torch.zeros(1, 1, *visible.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~visible, torch.finfo(dtype).min)
    same = (segments[:, :, None] == segments[:, None, :]).repeat(1, 1, step + 1)  # (B, L, (j+1) L)
    visible = visible[None] & same
    mask = torch.zeros(visible.shape[0], 1, *visible.shape[1:], dtype=dtype, device=device)
    return mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)


@dataclasses.dataclass
class Pairs:
    """One batch as the EAGLE objectives read it: position t pairs the target's feature at t with token
    t+1 and is scored on token t+2. B rows, T tokens, L = T - 1 pairs, H hidden."""

    features: torch.Tensor
    """(B, T, layers, H) the target's hidden states (the kind's feature layers, the final one last)."""
    embeds: torch.Tensor
    """(B, L, H) embeddings of tokens 1..T-1, in the drafter's dtype."""
    positions: torch.Tensor
    """(B, L) each pair's position within its conversation."""
    segments: torch.Tensor | None
    """(B, L) each pair's conversation in a packed batch; None unpacked."""
    mask: torch.Tensor
    """(B, T-2) bool: pair t is scored (token t+2 is an assistant token of t's conversation)."""
    target_states: torch.Tensor
    """(B, T-2, H) the target's final normed state at t+1, whose LM head gives the teacher at t."""
    lm_head: nn.Linear
    ranks: int
    """Rank hits to count per depth (held out: the tree's top-k; 0 while training)."""

    @property
    def length(self) -> int:  # L
        return self.embeds.shape[1]


class EagleObjectiveBase(DrafterObjective):
    """The EAGLE family's objective: a frozen target, one drafter module trained against the target's
    next-token distribution; stats use "head k" for draft depth k+1 (the unrolled step). Subclasses
    say how the drafter is built (:meth:`_new_drafter`) and scored (:meth:`_losses`)."""

    def __init__(self, run: RunConfig, target_model: nn.Module, train_data=None,
                 chunk_elements: int = LOSS_CHUNK_ELEMENTS):
        super().__init__()
        config = run.drafter.eagle
        self.config, self.tree, self.top_k, self.chunk_elements = config, run.drafter.tree, run.train.top_k, chunk_elements
        target_model.requires_grad_(False)
        self.target = target_model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(run.train.seed)
            self.drafter = self._new_drafter(self._dims(run, target_model)).float()
        self.steps = 1
        self.feature_layers = get_kind(run.drafter.kind).feature_layers(
            run, target_model.config.get_text_config().num_hidden_layers)

    def _dims(self, run: RunConfig, target_model):
        raise NotImplementedError

    def _new_drafter(self, dims) -> nn.Module:
        raise NotImplementedError

    def drafter_module(self, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        if state is None:
            return self.drafter
        with torch.random.fork_rng(devices=[]):
            drafter = self._new_drafter(self.drafter.dims).float()
        drafter.load_state_dict(subtree(state, "drafter"))
        return drafter

    def decode_defaults(self, rank_accuracy: torch.Tensor | None) -> dict:
        """The dynamic tree of ``drafter.tree``, stored with the export."""
        return {"tree": {"depth": self.tree.depth, "top_k": self.tree.top_k, "max_nodes": self.tree.max_nodes}}

    def predicted_tau(self, rank_accuracy: torch.Tensor) -> float:
        """Scored by the static tree of the same depth, top-k and node count (``expected_acceptance``)."""
        return expected_acceptance(rank_accuracy[:self.tree.depth, :self.tree.top_k], self.tree.max_nodes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                features: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        if features is None:
            with phase("target forward"):
                features = target_features(self.target, input_ids, attention_mask, self.feature_layers, position_ids)
        lm_head = as_linear(self.target.get_output_embeddings(), "the target's LM head")
        unshard_units(self.drafter)
        B, T = input_ids.shape
        L = T - 1  # pair positions t = 0..T-2: (feature at t, token t+1)
        device, dtype = input_ids.device, next(self.drafter.parameters()).dtype
        # Held out: how often the label has rank 0..R-1, R the tree's top-k (the predicted acceptance length).
        K, R = self.steps, 1 if self.training else max(1, self.tree.top_k)
        loss = zero_loss(self.drafter)
        if L < 2:  # train.loop.collate pads every batch to MIN_BATCH_LENGTH (3) positions
            raise SelfdraftError(f"EAGLE trains on batches of at least 3 positions, got {T}")
        mask = (loss_mask.bool() & attention_mask.bool())[:, 2:]  # (B, T-2): token t+2 is an assistant token
        # The drafter's inputs in its fp32 master weights' dtype (the target's may be bf16).
        embeds = self.target.get_input_embeddings()(input_ids[:, 1:]).detach().to(dtype)  # (B, L, H)
        if position_ids is None:
            positions, segments = torch.arange(L, device=device)[None].expand(B, L), None
        else:  # packed: pair t belongs to position t's conversation, and token t+2 must too
            positions, segments = position_ids[:, :L], segments_of(position_ids)
            mask = mask & (segments[:, 2:] == segments[:, :-2])
            segments = segments[:, :L]
        # The teacher: the target's view of token t+2, its final normed state at t+1 through its LM head,
        # computed by the loss at the supervised positions only.
        target_states = features[:, 1:T - 1, -1]  # (B, T-2, H)
        pairs = Pairs(features, embeds, positions, segments, mask, target_states, lm_head, 0 if self.training else R)
        total, table, tokens = self._losses(pairs)
        return loss + total, depth_stats(table, tokens, K, R)

    def _losses(self, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(the loss, the loss table of ``head_losses`` (K, 3 + ranks), the scored pairs per depth)."""
        raise NotImplementedError


class Eagle1Objective(EagleObjectiveBase):
    """EAGLE-1: regression of the next feature (smooth L1) + KL of its logits to the target's, with
    noise on the input features."""

    def _dims(self, run: RunConfig, target_model) -> Eagle1Dims:
        return Eagle1Dims.for_target(target_model, layer=run.drafter.eagle.layer)

    def _new_drafter(self, dims: Eagle1Dims) -> Eagle1Head:
        return Eagle1Head(dims)

    def _losses(self, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        cfg, mask, lm_head, L = self.config, pairs.mask, pairs.lm_head, pairs.length
        dtype, device = pairs.embeds.dtype, pairs.embeds.device
        feats = pairs.features[:, :, -1].to(dtype)  # (B, T, H) final normed features
        x = feats[:, :-1]
        if self.training and cfg.feature_noise > 0:
            x = x + (torch.rand_like(x) * 2 - 1) * cfg.feature_noise
        with phase("drafter forward, step 0"):
            causal = None if pairs.segments is None else ttt_mask(L, 0, dtype, device, pairs.segments)
            pred = self.drafter(x, pairs.embeds, pairs.positions, causal)[:, :L - 1]  # (B, T-2, H) ~ f_{t+1}
        p_hat, f_true = pred[mask], feats[:, 1:L][mask]  # (M, H); M may be 0 (collective safety)
        m = len(p_hat)
        reg = F.smooth_l1_loss(p_hat, f_true, reduction="sum") / max(1, p_hat.numel())  # the mean, 0 if empty
        # Eagle1Head.logits(p_hat, lm_head) == lm_head(p_hat): the target's head, full vocabulary.
        group = Group(p_hat, lm_head, torch.arange(m, device=device), 1.0)
        with phase("losses"):
            kl, table = head_losses([group], Teacher(hidden=pairs.target_states[mask], head=lm_head), top_k=self.top_k,
                                    ranks=pairs.ranks, chunk_elements=self.chunk_elements)
        return cfg.regression_weight * reg + cfg.kl_weight * kl, table, [m]


class Eagle3Objective(EagleObjectiveBase):
    """EAGLE-3: KL to the target's distribution over the draft vocabulary, unrolled for ``ttt_steps``
    on the drafter's own features (training-time test), step j weighted by step_decay**j. The draft
    vocabulary is the training data's most frequent assistant tokens; the drafter's LM head and final
    norm start as the target's rows and norm."""

    def __init__(self, run: RunConfig, target_model, train_data=None, **kwargs):
        super().__init__(run, target_model, train_data, **kwargs)
        self.steps = self.config.ttt_steps
        if train_data is not None:  # else the map comes with a checkpoint
            self._start_from_target(target_model, train_data)

    def _dims(self, run: RunConfig, target_model) -> Eagle3Dims:
        e = run.drafter.eagle
        return Eagle3Dims.for_target(target_model, draft_vocab_size=e.draft_vocab_size,
                                     aux_layers=list(e.aux_layers) or None, layer=e.layer)

    def _new_drafter(self, dims: Eagle3Dims) -> Eagle3Head:
        return Eagle3Head(dims)

    def _start_from_target(self, target_model, train_data) -> None:
        text = target_model.config.get_text_config()
        ids = draft_vocabulary(train_data, text.vocab_size, self.config.draft_vocab_size)
        if len(ids) != self.drafter.draft_vocab_size:
            raise SelfdraftError(f"draft vocabulary of {len(ids)} tokens, expected {self.drafter.draft_vocab_size}")
        self.drafter.set_vocab_map(ids)
        head_weight = target_model.get_output_embeddings().weight
        final_norm = getattr(target_model.get_decoder(), "norm", None)
        norm_weight = getattr(final_norm, "weight", None)
        if norm_weight is None:
            logger.warning("the target's decoder has no final norm at .norm: the EAGLE-3 drafter's norm starts at ones")
        with torch.no_grad(), gathered([head_weight, norm_weight]):
            if not head_weight.is_meta:  # meta under FSDP's rank-0 loading: rank 0's copy is broadcast
                self.drafter.lm_head.weight.copy_(head_weight[ids].float())
            if norm_weight is not None and not norm_weight.is_meta:
                self.drafter.norm.weight.copy_(norm_weight.float())

    def _losses(self, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        cfg, mask, segments, positions, L = self.config, pairs.mask, pairs.segments, pairs.positions, pairs.length
        dtype, device, K = pairs.embeds.dtype, pairs.embeds.device, self.steps
        # Fused features of three layers, unrolled on its own outputs.
        aux = pairs.features[:, :-1, :-1].flatten(2).to(dtype)  # (B, L, 3H): the aux layers side by side
        with phase("drafter forward, fuse"):
            feature = self.drafter.fuse(aux)  # (B, L, H)
        marks = [("drafter backward, fuse", feature)]
        draft_ids = self.drafter.draft_to_target()  # (V',)
        # The label is the target's own argmax, as a draft id (-1 when outside the draft vocabulary).
        to_draft = torch.full((self.drafter.vocab_size,), -1, dtype=torch.long, device=device)
        to_draft[draft_ids] = torch.arange(len(draft_ids), device=device)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.drafter.layer_config)
        t_index = torch.arange(L - 1, device=device)[None]  # (1, T-2)
        outputs, selections = [], []
        for j in range(K):
            with phase(f"drafter forward, step {j}"):
                step_out = self.drafter(feature, pairs.embeds, positions, ttt_mask(L, j, dtype, device, segments),
                                        cache=cache)  # (B, L, H)
            marks.insert(0, (f"drafter backward, step {j}", step_out))
            # Position t has j own-feature ancestors only if it is at least j into its conversation.
            selections.append(mask & ((t_index if segments is None else positions[:, :L - 1]) >= j))
            outputs.append(step_out)
            feature = torch.cat([torch.zeros_like(step_out[:, :1]), step_out[:, :-1]], dim=1)  # t takes t-1's output
        need, rows = teacher_rows(selections)  # need == mask (step 0 selects all of it)
        groups = []
        for j, (step_out, sel, step_rows) in enumerate(zip(outputs, selections, rows)):
            # Every step's group, empty ones too (collective safety, zero_loss).
            # Eagle3Head.logits(x) == lm_head(norm(x)): the norm here, the projection in the loss.
            h = self.drafter.norm(step_out[:, :L - 1][sel])  # (M, H)
            groups.append(Group(h, self.drafter.lm_head, step_rows, cfg.step_decay ** j))
        # KL to the target's distribution restricted to the draft vocabulary and renormalised there.
        teacher = Teacher(hidden=pairs.target_states[need], head=pairs.lm_head, columns=draft_ids, to_label=to_draft)
        with phase("losses"):
            total, table = head_losses(groups, teacher, top_k=self.top_k, ranks=pairs.ranks,
                                       chunk_elements=self.chunk_elements)
        if recording() is not None and recording().only is None and torch.is_grad_enabled():
            recording().backward_marks(marks)
        return total, table, [len(g.rows) for g in groups]
