"""Training objectives: the trainable module that the one loop optimises, and its loss.

An objective is an ``nn.Module`` holding the target and the drafter. ``forward(batch)`` takes the
target's features (``feature_layers`` of them) from the batch when they were precomputed, else runs
the frozen target for them (``features.target_features``; Medusa-2 runs its LoRA-adapted target with
gradients), computes the drafter's loss, and returns ``(loss, stats)`` where
``stats`` holds *sums* (per-head loss x tokens, top-1/top-k hits, rank hits, token counts), so that
micro batches and processes aggregate exactly by adding them up.

Batch layout (right-padded): ``input_ids`` (B, T) long, ``attention_mask`` (B, T) long,
``loss_mask`` (B, T) long, 1 on assistant tokens; optional ``features`` (B, T, layers, H), zeros on
padding.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from selfdraft.configs.run import MedusaConfig, RunConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.medusa import MedusaHeads
from selfdraft.train.features import feature_layers, target_features


def _zero_loss(module: nn.Module) -> torch.Tensor:
    """0 connected to every parameter of ``module``: a batch with no supervised position still
    backpropagates (zero) gradients, so processes never disagree on which parameters got one."""
    return sum(p.sum() for p in module.parameters()) * 0.0


def _load_trainable(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the tensors ``module.trainable_state_dict()`` names, which it must match."""
    mine = module.trainable_state_dict()
    if set(mine) != set(state) or any(mine[n].shape != state[n].shape for n in mine):
        missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise SelfdraftError(f"checkpoint does not fit this run's drafter: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for n, tensor in module.state_dict(keep_vars=True).items():
            if n in state:
                tensor.copy_(state[n])


def _top_hits(logits: torch.Tensor, label: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How many rows of logits (M, V) rank the label (M,) first, and within the top k."""
    top = logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices  # (M, k)
    return (top[:, 0] == label).sum(), (top == label[:, None]).any(-1).sum()


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
        self.feature_layers = feature_layers("medusa", cfg.num_hidden_layers)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters being trained (heads, plus LoRA weights in Medusa-2), by name."""
        return {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}

    load_trainable_state_dict = _load_trainable

    def _lm_head(self) -> nn.Module:
        return self.target.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                features: torch.Tensor | None = None):
        cfg = self.config
        lm_head = self._lm_head()
        if self.lora:  # Medusa-2: the adapted target runs with gradients, its features are not fixed
            if features is not None:
                raise SelfdraftError("Medusa-2 trains the target: precomputed features do not apply")
            out = self.target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            hidden, target_logits = out.hidden_states[-1], out.logits  # (B, T, D), (B, T, V)
        else:
            if features is None:
                features = target_features(self.target, input_ids, attention_mask, self.feature_layers)
            hidden = features[:, :, -1]  # (B, T, D): final normed state, lm_head(hidden) == logits
            with torch.no_grad():
                target_logits = lm_head(hidden.to(lm_head.weight.dtype))  # (B, T, V)
        heads_dtype = next(self.heads.parameters()).dtype
        B, T = input_ids.shape
        K = cfg.num_heads
        R = cfg.tree_ranks
        device = input_ids.device
        loss = _zero_loss(self.heads)
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
                    stats["top1"][k], stats["topk"][k] = _top_hits(logits, label, self.top_k)
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


def draft_vocabulary(train_data, vocab_size: int, size: int) -> torch.Tensor:
    """EAGLE-3's draft vocabulary: the ``size`` most frequent assistant tokens of the training data
    (ties by smaller id), padded with the smallest unused ids if fewer distinct tokens occur; (V',)."""
    import numpy as np

    size = min(size, vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in train_data:
        np.add.at(counts, ids[mask.astype(bool)], 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, then id ascending
    return torch.from_numpy(np.sort(order[:size]).copy())


def _ttt_mask(length: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """EAGLE-3 training-time test attention at unrolled step j: (1, 1, L, (j+1) L) additive.

    Query t sees step-0 keys (true target features) at positions <= t - j, and the key of step i
    (1 <= i <= j, the drafter's own features) at position t - j + i: exactly what a depth-(j+1) tree
    node sees in decoding (the committed cache, then its ancestors, then itself)."""
    t = torch.arange(length, device=device)[:, None]  # (L, 1)
    s = torch.arange(length, device=device)[None, :]  # (1, L)
    blocks = [s <= t - step] + [s == t - step + i for i in range(1, step + 1)]
    visible = torch.cat(blocks, dim=1)  # (L, (j+1) L)
    mask = torch.zeros(1, 1, *visible.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


class EagleObjective(nn.Module):
    """EAGLE-1: regression of the next feature (smooth L1) + KL of its logits to the target's, with
    noise on the input features. EAGLE-3: KL to the target's distribution over the draft vocabulary,
    unrolled for ``ttt_steps`` on the drafter's own features (training-time test), step j weighted by
    step_decay**j. Stats use "head k" for draft depth k+1 (the unrolled step)."""

    lora = False

    def __init__(self, target_model: nn.Module, kind: str, config, top_k: int, seed: int, train_data=None):
        super().__init__()
        from selfdraft.heads.eagle import EagleDrafter

        self.kind, self.config, self.top_k = kind, config, top_k
        target_model.requires_grad_(False)
        self.target = target_model
        text = target_model.config.get_text_config()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            dims = EagleDrafter.dims_for(target_model, kind, draft_vocab_size=config.draft_vocab_size,
                                         aux_layers=list(config.aux_layers) or None, layer=config.layer)
            self.drafter = EagleDrafter(dims).float()
        if kind == "eagle3" and train_data is not None:  # else the map comes with a checkpoint
            ids = draft_vocabulary(train_data, text.vocab_size, config.draft_vocab_size)
            if len(ids) != self.drafter.draft_vocab_size:
                raise SelfdraftError(f"draft vocabulary of {len(ids)} tokens, expected {self.drafter.draft_vocab_size}")
            self.drafter.set_vocab_map(ids)
            with torch.no_grad():  # start from the target's head rows and final norm
                self.drafter.lm_head.weight.copy_(target_model.get_output_embeddings().weight[ids].float())
                final_norm = getattr(getattr(target_model, "model", None), "norm", None)
                if final_norm is not None and hasattr(final_norm, "weight"):
                    self.drafter.norm.weight.copy_(final_norm.weight.float())
        self.steps = 1 if kind == "eagle" else config.ttt_steps
        self.feature_layers = feature_layers(kind, text.num_hidden_layers, self.drafter.dims.get("aux_layers", ()))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Trained parameters plus the drafter's persistent buffers (EAGLE-3's d2t/t2d maps)."""
        state = {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}
        keys = set(self.drafter.state_dict())
        state.update({f"drafter.{n}": b for n, b in self.drafter.named_buffers() if n in keys})
        return state

    load_trainable_state_dict = _load_trainable

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                features: torch.Tensor | None = None):
        from transformers import DynamicCache

        cfg = self.config
        if features is None:
            features = target_features(self.target, input_ids, attention_mask, self.feature_layers)
        lm_head = self.target.get_output_embeddings()
        B, T = input_ids.shape
        L = T - 1  # pair positions t = 0..T-2: (feature at t, token t+1)
        device, dtype = input_ids.device, next(self.drafter.parameters()).dtype
        K, R = self.steps, 1
        stats = {"head_loss": torch.zeros(K, device=device), "head_tokens": torch.zeros(K, device=device),
                 "top1": torch.zeros(K, device=device), "topk": torch.zeros(K, device=device),
                 "rank_hits": torch.zeros(K, R, device=device)}
        loss = _zero_loss(self.drafter)
        if L < 2:
            return loss, stats
        mask = (loss_mask.bool() & attention_mask.bool())[:, 2:]  # (B, T-2): token t+2 is an assistant token
        embeds = self.target.get_input_embeddings()(input_ids[:, 1:]).detach().to(dtype)  # (B, L, H)
        positions = torch.arange(L, device=device)[None].expand(B, L)
        with torch.no_grad():  # (B, T-2, V): the target's view of token t+2
            target_logits = lm_head(features[:, 1:T - 1, -1].to(lm_head.weight.dtype)).float()
        if self.kind == "eagle":
            feats = features[:, :, -1].to(dtype)  # (B, T, H) final normed features
            x = feats[:, :-1]
            if self.training and cfg.feature_noise > 0:
                x = x + (torch.rand_like(x) * 2 - 1) * cfg.feature_noise
            pred = self.drafter(x, embeds, positions, None)[:, : T - 2]  # (B, T-2, H) ~ f_{t+1}
            m = int(mask.sum())
            if m == 0:
                return loss, stats
            p_hat, f_true = pred[mask], feats[:, 1:T - 1][mask]  # (M, H)
            reg = F.smooth_l1_loss(p_hat, f_true)
            logits = self.drafter.logits(p_hat, lm_head).float()  # (M, V)
            log_p = F.log_softmax(target_logits[mask], dim=-1)
            kl = F.cross_entropy(logits, log_p.exp()) + (log_p.exp() * log_p).sum(-1).mean()
            loss = cfg.regression_weight * reg + cfg.kl_weight * kl
            self._stats(stats, 0, kl, logits, log_p.argmax(-1), m)
            return loss, stats
        # EAGLE-3: fused features of three layers, unrolled on its own outputs.
        aux = features[:, :-1, :-1].flatten(2).to(dtype)  # (B, L, 3H): the aux layers side by side
        feature = self.drafter.fuse(aux)  # (B, L, H)
        draft_ids = self.drafter.draft_to_target()  # (V',)
        log_p_all = F.log_softmax(target_logits[..., draft_ids], dim=-1)  # (B, T-2, V') renormalised on V'
        # The label is the target's own argmax, as a draft id (-1 when outside the draft vocabulary).
        to_draft = torch.full((self.drafter.vocab_size,), -1, dtype=torch.long, device=device)
        to_draft[draft_ids] = torch.arange(len(draft_ids), device=device)
        labels = to_draft[target_logits.argmax(-1)]  # (B, T-2)
        cache = DynamicCache(config=self.drafter.layer_config)
        t_index = torch.arange(T - 2, device=device)[None]  # (1, T-2)
        for j in range(K):
            step_out = self.drafter(feature, embeds, positions, _ttt_mask(L, j, dtype, device), cache=cache)  # (B, L, H)
            sel = mask & (t_index >= j)  # position t has j own-feature ancestors only if t >= j
            m = int(sel.sum())
            if m:
                logits = self.drafter.logits(step_out[:, : T - 2][sel]).float()  # (M, V')
                log_p = log_p_all[sel]
                kl = F.cross_entropy(logits, log_p.exp()) + (log_p.exp() * log_p).sum(-1).mean()
                loss = loss + cfg.step_decay ** j * kl
                self._stats(stats, j, kl, logits, labels[sel], m)
            feature = torch.cat([torch.zeros_like(step_out[:, :1]), step_out[:, :-1]], dim=1)  # t takes t-1's output
        return loss, stats

    def _stats(self, stats, k, loss, logits, label, m) -> None:
        with torch.no_grad():
            stats["head_loss"][k] = loss.detach() * m
            stats["head_tokens"][k] = m
            stats["top1"][k], stats["topk"][k] = _top_hits(logits, label, self.top_k)


def build_objective(config: RunConfig, target_model: nn.Module, train_data=None) -> nn.Module:
    kind = config.drafter.kind
    if kind == "medusa":
        return MedusaObjective(target_model, config.drafter.medusa, top_k=config.train.top_k, seed=config.train.seed)
    return EagleObjective(target_model, kind, config.drafter.eagle, top_k=config.train.top_k, seed=config.train.seed,
                          train_data=train_data)


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
