"""Training objectives: the trainable module that the one loop optimises, and its loss.

An objective is an ``nn.Module`` holding the target and the drafter. ``forward(batch)`` runs the
target (under no_grad when it is frozen), the drafter's loss, and returns ``(loss, stats)`` where
``stats`` holds *sums* (per-head loss x tokens, top-1/top-k hits, rank hits, token counts), so that
micro batches and processes aggregate exactly by adding them up.

Batch layout (right-padded): ``input_ids`` (B, T) long, ``attention_mask`` (B, T) long,
``loss_mask`` (B, T) long, 1 on assistant tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from selfdraft.configs.run import MedusaConfig, RunConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.medusa import MedusaHeads


class MedusaObjective(nn.Module):
    """Medusa-1 (frozen target) or Medusa-2 (LoRA on the target, trained jointly).

    Head k at position t reads the target's final hidden state h_t and predicts token t+2+k. Its
    label is the target's own next-token distribution at position t+1+k (``labels: target``, a KL
    loss; top-k accuracy is measured against the target's argmax, which is what greedy verification
    accepts) or the data's token t+2+k (``labels: data``, cross-entropy). Only positions whose
    predicted token is an assistant token count. Head k's loss is weighted by ``head_decay**k``.
    """

    def __init__(self, target_model: nn.Module, config: MedusaConfig, top_k: int, seed: int):
        super().__init__()
        cfg = target_model.config.get_text_config()
        self.config, self.top_k = config, top_k
        self.lora = config.lora.rank > 0
        if self.lora:
            from peft import LoraConfig, get_peft_model

            target_model = get_peft_model(target_model, LoraConfig(
                r=config.lora.rank, lora_alpha=config.lora.alpha, lora_dropout=config.lora.dropout,
                target_modules=list(config.lora.target_modules), bias="none"))
        else:
            target_model.requires_grad_(False)
        self.target = target_model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, config.num_heads, config.num_layers,
                                     own_lm_head=config.own_lm_head)
            if config.own_lm_head:  # start every head's projection as the target's LM head (Medusa)
                weight = target_model.get_output_embeddings().weight
                for head in self.heads.lm_heads:
                    head.weight.data.copy_(weight.detach().float())
        self.heads.float()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters being trained (heads, plus LoRA weights in Medusa-2), by name."""
        return {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        if set(params) != set(state) or any(params[n].shape != state[n].shape for n in params):
            missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise SelfdraftError(f"checkpoint does not fit this run's drafter: missing {missing[:4]}, unexpected {unexpected[:4]}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state[n])

    def _lm_head(self) -> nn.Module:
        return self.target.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor):
        cfg = self.config
        grad_target = self.lora and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad_target):
            out = self.target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # (B, T, D): final normed state, lm_head(hidden) == logits
        target_logits = out.logits  # (B, T, V)
        lm_head = self._lm_head()
        heads_dtype = next(self.heads.parameters()).dtype
        B, T = input_ids.shape
        K = cfg.num_heads
        R = cfg.tree_ranks
        device = input_ids.device
        loss = hidden.new_zeros((), dtype=torch.float32)
        stats = {
            "head_loss": torch.zeros(K, device=device), "head_tokens": torch.zeros(K, device=device),
            "top1": torch.zeros(K, device=device), "topk": torch.zeros(K, device=device),
            "rank_hits": torch.zeros(K, R, device=device),
        }
        mask = loss_mask.bool() & attention_mask.bool()
        if cfg.labels == "target":
            # The target's next-token distribution at every position, once for all heads (B, T, V),
            # and its entropy (B, T): KL(p || q) = CE(p, q) - H(p).
            log_p_all = F.log_softmax(target_logits.detach().float(), dim=-1)
            entropy_all = -(log_p_all.exp() * log_p_all).sum(-1)
        for k in range(K):
            n = T - 2 - k
            if n <= 0:
                continue
            sel = mask[:, 2 + k:]  # (B, n): is the predicted token t+2+k an assistant token
            if self.training and cfg.position_fraction < 1:
                sel = sel & (torch.rand(sel.shape, device=device) < cfg.position_fraction)
            m = int(sel.sum())
            if m == 0:
                continue
            h = hidden[:, :n][sel].to(heads_dtype)  # (M, D)
            logits = self.heads.head_logits(k, h, lm_head).float()  # (M, V)
            if cfg.labels == "target":
                log_p = log_p_all[:, 1 + k:1 + k + n][sel]  # (M, V): the target's view of token t+2+k
                head_loss = F.cross_entropy(logits, log_p.exp()) - entropy_all[:, 1 + k:1 + k + n][sel].mean()
                label = log_p.argmax(-1)  # (M,)
            else:
                label = input_ids[:, 2 + k:][sel]  # (M,)
                head_loss = F.cross_entropy(logits, label)
            loss = loss + cfg.head_decay ** k * head_loss
            with torch.no_grad():
                stats["head_loss"][k] = head_loss.detach() * m
                stats["head_tokens"][k] = m
                if self.training:  # cheap: top-1 and top-k only
                    top = logits.topk(self.top_k, dim=-1).indices  # (M, k)
                    stats["top1"][k] = (top[:, 0] == label).sum()
                    stats["topk"][k] = (top == label[:, None]).any(-1).sum()
                else:  # the rank of the label among the head's logits, for the sparse tree
                    rank = (logits > logits.gather(-1, label[:, None])).sum(-1)  # (M,)
                    stats["top1"][k] = (rank == 0).sum()
                    stats["topk"][k] = (rank < self.top_k).sum()
                    stats["rank_hits"][k] = torch.bincount(rank.clamp(max=R), minlength=R + 1)[:R].float()
        if self.lora and cfg.lora.lm_loss_weight > 0:
            lm_loss, lm_tokens = self._lm_loss(input_ids, attention_mask, mask, target_logits)
            loss = loss + cfg.lora.lm_loss_weight * lm_loss
            stats["lm_loss"] = (lm_loss.detach() * lm_tokens).reshape(1)
            stats["lm_tokens"] = torch.tensor([float(lm_tokens)], device=device)
        return loss, stats

    def _lm_loss(self, input_ids, attention_mask, mask, logits):
        """The target's own loss in Medusa-2, on positions that predict an assistant token."""
        sel = mask[:, 1:]  # (B, T-1)
        m = int(sel.sum())
        if m == 0:
            return logits.new_zeros((), dtype=torch.float32), 0
        log_q = F.log_softmax(logits[:, :-1][sel].float(), dim=-1)  # (M, V)
        if self.config.lora.lm_loss == "ce":
            return F.nll_loss(log_q, input_ids[:, 1:][sel]), m
        with torch.no_grad(), self.target.disable_adapter():
            ref = self.target(input_ids=input_ids, attention_mask=attention_mask).logits
        log_p = F.log_softmax(ref[:, :-1][sel].float(), dim=-1)
        return F.kl_div(log_q, log_p, log_target=True, reduction="sum") / m, m

    def merged_target(self) -> nn.Module:
        """The target the heads decode with: the LoRA-merged model in Medusa-2, the frozen one otherwise."""
        if not self.lora:
            return self.target
        import copy

        return copy.deepcopy(self.target).merge_and_unload()


def build_objective(config: RunConfig, target_model: nn.Module) -> MedusaObjective:
    if config.drafter.kind != "medusa":
        raise SelfdraftError(f"drafter kind {config.drafter.kind!r} has no training objective yet")
    return MedusaObjective(target_model, config.drafter.medusa, top_k=config.train.top_k, seed=config.train.seed)


def summarise(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Turn summed stats into per-head means: loss/head{k}, top1/head{k}, top{k}/head{k}, lm_loss."""
    out: dict[str, float] = {}
    tokens = stats["head_tokens"]
    for k in range(len(tokens)):
        n = float(tokens[k])
        if n > 0:
            out[f"loss/head{k}"] = float(stats["head_loss"][k]) / n
            out[f"top1/head{k}"] = float(stats["top1"][k]) / n
            out[f"topk/head{k}"] = float(stats["topk"][k]) / n
    if "lm_tokens" in stats and float(stats["lm_tokens"].sum()) > 0:
        out["lm_loss"] = float(stats["lm_loss"].sum()) / float(stats["lm_tokens"].sum())
    return out


def rank_accuracy(stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """(K, R): share of positions where head k's rank-r token is the label (for the sparse tree)."""
    tokens = stats["head_tokens"].clamp(min=1)[:, None]
    return (stats["rank_hits"] / tokens).cpu()
