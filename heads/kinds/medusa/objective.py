"""Medusa's training objective (the training side of the kind: imported by the training loop only)."""

from __future__ import annotations

import torch
from torch import nn

from selfdraft.configs.run import RunConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.medusa.module import MedusaHeads
from selfdraft.heads.sparse_tree import CPU_CHOICES, expected_acceptance, sparse_tree
from selfdraft.train.features import target_features
from selfdraft.train.objectives import (LOSS_CHUNK_ELEMENTS, DrafterObjective, Group, Teacher, as_linear, depth_stats,
                                        gathered, head_losses, segments_of, subtree, teacher_rows, zero_loss)
from selfdraft.train.profile import phase


class MedusaObjective(DrafterObjective):
    """Medusa-1 (frozen target) or Medusa-2 (LoRA on the target, trained jointly).

    Head k at position t reads the target's final hidden state h_t and predicts token t+2+k. Its
    label is the target's own next-token distribution at position t+1+k (``labels: target``, a KL
    loss; top-k accuracy is measured against the target's argmax, which is what greedy verification
    accepts) or the data's token t+2+k (``labels: data``, cross-entropy). Only positions whose
    predicted token is an assistant token count. Head k's loss is weighted by ``head_decay**k``.
    """

    def __init__(self, run: RunConfig, target_model: nn.Module, train_data=None,
                 chunk_elements: int = LOSS_CHUNK_ELEMENTS):
        super().__init__()
        config, top_k, seed = run.drafter.medusa, run.train.top_k, run.train.seed
        cfg = target_model.config.get_text_config()
        self.config, self.tree, self.top_k, self.chunk_elements = config, run.drafter.tree, top_k, chunk_elements
        self.lora = config.lora.rank > 0
        if self.lora:
            from peft import LoraConfig, get_peft_model

            # Seeded here: the adapters' random start must not depend on what loading the target drew.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 1)
                target_model = get_peft_model(target_model, LoraConfig(
                    r=config.lora.rank, lora_alpha=config.lora.alpha, lora_dropout=config.lora.dropout,
                    target_modules=list(config.lora.target_modules), bias="none"))
        else:
            target_model.requires_grad_(False)
        self.target = target_model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._heads_args = (cfg.hidden_size, cfg.vocab_size, config.num_heads, config.num_layers, config.own_lm_head)
            self.heads = MedusaHeads(*self._heads_args)
            weight = target_model.get_output_embeddings().weight
            # (On meta when FSDP loads the weights on local rank 0 only; accelerate then broadcasts that
            # rank's whole objective, these copies included.)
            if config.own_lm_head and not weight.is_meta:  # start every head's projection as the target's LM head
                with gathered([weight]):
                    for head in self.heads.lm_heads:
                        head.weight.data.copy_(weight.detach().float())
        self.heads.float()
        self.feature_layers = [cfg.num_hidden_layers]

    def drafter_module(self, state: dict[str, torch.Tensor] | None = None) -> MedusaHeads:
        """The heads; with ``state`` (full tensors, as ``trainable_state_dict`` names them, e.g. gathered
        from FSDP shards) a new, unsharded copy holding them."""
        if state is None:
            return self.heads
        with torch.random.fork_rng(devices=[]):
            heads = MedusaHeads(*self._heads_args).float()
        heads.load_state_dict(subtree(state, "heads"))
        return heads

    def decode_defaults(self, rank_accuracy: torch.Tensor | None) -> dict:
        """The sparse tree of ``drafter.tree.max_nodes`` nodes from the measured accuracies, stored with
        them (``--max-nodes`` rebuilds it for another budget); before any evaluation, a fixed small tree."""
        if rank_accuracy is None:
            return {"choices": [list(c) for c in CPU_CHOICES if len(c) <= self.heads.num_heads]}
        return {"choices": [list(c) for c in sparse_tree(rank_accuracy, self.tree.max_nodes)],
                "rank_accuracy": [[round(float(a), 6) for a in row] for row in rank_accuracy]}

    def predicted_tau(self, rank_accuracy: torch.Tensor) -> float:
        return expected_acceptance(rank_accuracy, self.tree.max_nodes)

    def _lm_head(self) -> nn.Module:
        return self.target.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                features: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        cfg = self.config
        lm_head = as_linear(self._lm_head(), "the target's LM head")
        packed = position_ids is not None
        segments = segments_of(position_ids) if packed else None
        if self.lora:  # Medusa-2: the adapted target runs with gradients, its features are not fixed
            if features is not None:
                raise SelfdraftError("Medusa-2 trains the target: precomputed features do not apply")
            # logits_to_keep=1: the losses project the hidden states themselves, a chunk at a time.
            with phase("target forward (LoRA, with gradients)"):
                # Packed: no attention mask, so that transformers keeps attention within each conversation.
                # use_cache=False: with a cache, transformers does not look for packed sequences.
                out = self.target(input_ids=input_ids, attention_mask=None if packed else attention_mask,
                                  position_ids=position_ids, output_hidden_states=True, use_cache=False,
                                  logits_to_keep=1)
            hidden = out.hidden_states[-1]  # (B, T, D) final normed state, with LoRA gradients
        else:
            if features is None:
                with phase("target forward"):
                    features = target_features(self.target, input_ids, attention_mask, self.feature_layers,
                                               position_ids)
            hidden = features[:, :, -1]  # (B, T, D): final normed state, lm_head(hidden) == logits
        heads_dtype = next(self.heads.parameters()).dtype
        B, T = input_ids.shape
        K = cfg.num_heads
        R = cfg.tree_ranks
        device = input_ids.device
        loss = zero_loss(self.heads)
        mask = loss_mask.bool() & attention_mask.bool()
        # Head k at position t is scored at the target's position u = t+1+k: against the target's
        # distribution there (labels: target) or the data's next token, input_ids[u+1] (labels: data).
        chosen = []  # (k, sel (B, n) over t, the same (B, T) over u = t+1+k)
        for k in range(K):
            n = max(0, T - 2 - k)  # positions t with a token t+2+k (none in a short batch: an empty group)
            sel = mask[:, 2 + k:]  # (B, n): is the predicted token t+2+k an assistant token
            if packed:  # ... of the conversation of position t
                sel = sel & (segments[:, 2 + k:] == segments[:, :n])
            if self.training and cfg.position_fraction < 1:
                sel = sel & (torch.rand(sel.shape, device=device) < cfg.position_fraction)
            at = torch.zeros(B, T, dtype=torch.bool, device=device)
            at[:, 1 + k:1 + k + n] = sel
            chosen.append((k, sel, at))
        need, rows = teacher_rows([at for _, _, at in chosen])  # need (B, T): the positions u in use
        groups = []
        for (k, sel, _), head_rows in zip(chosen, rows):
            # Every head runs, on zero rows when the batch has none for it (collective safety, zero_loss).
            # The target's (maybe bf16) state, cast to the heads' fp32 master weights' dtype; then head k's
            # blocks (MedusaHeads.head_logits, less its vocabulary projection, which the loss applies).
            with phase("drafter forward"):
                h = self.heads.blocks[k](hidden[:, :sel.shape[1]][sel].to(heads_dtype))  # (M, D)
            head = self.heads.lm_heads[k] if self.heads.lm_heads is not None else lm_head
            groups.append(Group(h, head, head_rows, cfg.head_decay ** k))
        if cfg.labels == "target":
            teacher = Teacher(hidden=hidden.detach()[need], head=lm_head)
        else:
            following = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # (B, T): token u+1 at u
            teacher = Teacher(labels=following[need])
        with phase("losses"):
            total, table = head_losses(groups, teacher, top_k=self.top_k, ranks=0 if self.training else R,
                                        chunk_elements=self.chunk_elements)
        loss = loss + total
        stats = depth_stats(table, [len(g.rows) for g in groups], K, R)
        if self.lora and cfg.lora.lm_loss_weight > 0:
            lm_loss, lm_tokens = self._lm_loss(input_ids, attention_mask, mask, hidden, lm_head, position_ids)
            loss = loss + cfg.lora.lm_loss_weight * lm_loss
            stats["lm_loss"] = (lm_loss.detach() * lm_tokens).reshape(1)
            stats["lm_tokens"] = torch.tensor([float(lm_tokens)], device=device)
        return loss, stats

    def _lm_loss(self, input_ids, attention_mask, mask, hidden, lm_head, position_ids=None):
        """The target's own loss in Medusa-2, on positions that predict an assistant token: against the
        data (``ce``) or the target without its adapter (``kl``); hidden (B, T, D) with gradients."""
        sel = mask[:, 1:]  # (B, T-1)
        if position_ids is not None:  # packed: the next token must be of the same conversation
            segments = segments_of(position_ids)
            sel = sel & (segments[:, 1:] == segments[:, :-1])
        h = hidden[:, :-1][sel]  # (M, D)
        m = len(h)  # may be 0: the adapter-free forward still runs on every process (collective safety)
        if self.config.lora.lm_loss == "ce":
            teacher = Teacher(labels=input_ids[:, 1:][sel])
        else:
            with torch.no_grad(), self.target.disable_adapter():
                ref = self.target(input_ids=input_ids, attention_mask=None if position_ids is not None else attention_mask,
                                  position_ids=position_ids, output_hidden_states=True, use_cache=False,
                                  logits_to_keep=1).hidden_states[-1]  # (B, T, D)
            teacher = Teacher(hidden=ref[:, :-1][sel], head=lm_head)
        rows = torch.arange(m, device=h.device)
        loss, _ = head_losses([Group(h, lm_head, rows, 1.0)], teacher, top_k=1, ranks=0,
                               chunk_elements=self.chunk_elements)
        return loss, m

    def merged_target(self) -> nn.Module:
        """The target the heads decode with: the LoRA-merged model in Medusa-2, the frozen one otherwise."""
        if not self.lora:
            return self.target
        import copy

        return copy.deepcopy(self.target).merge_and_unload()
