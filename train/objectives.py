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

Memory: no (positions x vocabulary) tensor is ever built for a whole batch. Every loss is taken at
the supervised positions only, through ``_head_losses``: it projects a chunk of positions at a time
(``chunk_elements`` logits, about 128 MiB per fp32 tensor by default) onto the drafter's vocabulary
and the target's, and computes the loss's gradients in the same pass, so that only (positions x H)
gradients and the (V x H) weight gradients outlive a chunk.

Dtypes: the drafter's trainable weights are fp32 (master weights); the target may be bf16. Each
matmul runs in autocast's dtype when autocast is on (``train.mixed_precision``), else in the dtype of
the weight it multiplies (a bf16 target's LM head in bf16, as the target's own forward runs it; the
drafter's fp32 weights in fp32); softmaxes, losses and gradient sums are always fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from selfdraft.configs.run import MedusaConfig, RunConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.medusa import MedusaHeads
from selfdraft.train.features import feature_layers, target_features
from selfdraft.train.profile import phase, recording

LOSS_CHUNK_ELEMENTS = 1 << 24
"""Logits the losses hold at once, positions x vocabulary: a chunk has three or four fp32 tensors of
this size (64 MiB each), 130 positions of a 128k vocabulary, 341 of SmolLM2's 49k."""


def _zero_loss(module: nn.Module) -> torch.Tensor:
    """0 connected to every parameter of ``module``: DDP then sees a gradient for every parameter in
    every backward, whatever the batch held. Under DeepSpeed ZeRO-3 (partitioned parameters, which
    carry ``ds_id``) a plain 0: touching a partitioned parameter outside its module's forward would
    record its empty shard's shape for the gradient (the backward then fails with "invalid gradient ...
    expected shape compatible with [0]"), and ZeRO-3 counts the parameters a backward reaches itself.

    Collective safety: the objectives run every module of the drafter on every batch, on zero rows
    when a batch has nothing for it, so that all processes gather the same partitioned parameters in
    the same order (a data-dependent skip would deadlock ZeRO-3's all-gathers)."""
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        return torch.zeros((), device=params[0].device)
    return sum(p.sum() for p in params) * 0.0


def _gathered(params: list[torch.Tensor | None]):
    """Read ``params`` whole inside the context: a target created partitioned under DeepSpeed ZeRO-3
    (``zero3_init_flag``) holds a shard of each weight per process, gathered here and released after."""
    params = [p for p in params if p is not None]
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def _load_trainable(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the tensors ``module.trainable_state_dict()`` names, which it must match."""
    mine = module.trainable_state_dict()
    if set(mine) != set(state) or any(mine[n].shape != state[n].shape for n in mine):
        missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise SelfdraftError(f"checkpoint does not fit this run's drafter: missing {missing[:4]}, unexpected {unexpected[:4]}")
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for n, tensor in module.state_dict(keep_vars=True).items():
            if n in state:
                value = state[n].to(dtype=tensor.dtype)
                if isinstance(tensor, DTensor):  # FSDP2: this process's shard of the full tensor
                    value = distribute_tensor(value.to(tensor.device), tensor.device_mesh, tensor.placements)
                tensor.copy_(value)


def _unshard_units(module: nn.Module) -> None:
    """Gather the FSDP2 units inside ``module`` for this step. FSDP's auto-wrap makes a unit of every
    module of the target's decoder-layer class, the drafter's own layer of that class included, but the
    drafter calls that layer's parts rather than its forward, so the unit's hooks would never gather it.
    Gathered here, it stays so until FSDP's post-backward reduces its gradients and reshards it."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.unshard()


def _segments(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) conversation number of each position of a packed batch: positions restart at 0 where a
    conversation (or a row's trailing padding) begins (``train.loop.collate``)."""
    return (position_ids == 0).cumsum(-1)


def _subtree(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}


def _top_hits(logits: torch.Tensor, label: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How many rows of logits (M, V) rank the label (M,) first, and within the top k."""
    top = logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices  # (M, k)
    return (top[:, 0] == label).sum(), (top == label[:, None]).any(-1).sum()


def _linear(module: nn.Module, what: str) -> nn.Linear:
    """``module`` as the plain ``nn.Linear`` whose weight the losses project with directly."""
    if not isinstance(module, nn.Linear):
        raise SelfdraftError(f"{what} is a {type(module).__name__}: the losses project with its weight and need a "
                             "plain nn.Linear (for Medusa-2, keep lm_head out of drafter.medusa.lora.target_modules)")
    return module


@dataclasses.dataclass
class _Teacher:
    """What the drafter is scored against at N positions, a chunk of rows at a time and without
    gradient: the target's distribution, ``hidden`` (N, D) through its LM head ``head``, restricted to
    the vocabulary ``columns`` (V',) and renormalised there when given (a KL loss); or token ids
    ``labels`` (N,) (cross-entropy). The accuracy stats compare the drafter's top tokens with the
    target's argmax over its whole vocabulary, mapped through ``to_label`` when given (EAGLE-3: the
    draft id, -1 outside the draft vocabulary), or with ``labels``."""

    hidden: torch.Tensor | None = None
    head: nn.Linear | None = None
    columns: torch.Tensor | None = None
    to_label: torch.Tensor | None = None
    labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.labels if self.hidden is None else self.hidden)

    def vocab(self) -> int:
        return 0 if self.head is None else self.head.out_features

    def chunk(self, rows: slice, weight: torch.Tensor | None, bias: torch.Tensor | None):
        """The teacher at ``rows``: (p (C, V or V') fp32, sum p log p (C,), labels (C,)) for a KL loss,
        or (None, None, labels (C,)); ``weight``/``bias``: the LM head's, cast to the matmul dtype."""
        if self.hidden is None:
            return None, None, self.labels[rows]
        # The full vocabulary (C, V), in the matmul dtype: the stats need the target's argmax over all
        # of it, and the draft columns are then an index away (cheaper than a second, gathered matmul).
        logits = F.linear(self.hidden[rows].to(weight.dtype), weight, bias)
        label = logits.argmax(-1)
        if self.to_label is not None:
            label = self.to_label[label]
        if self.columns is not None:
            logits = logits[:, self.columns]  # (C, V')
        log_p = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        del logits
        p = log_p.exp()
        return p, _row_dot(p, log_p), label


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(C,) dot products of the rows of a and b (C, V), without a (C, V) product in memory."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).view(-1)


@dataclasses.dataclass
class _Group:
    """One loss term: the drafter's features ``hidden`` (M, D) (with gradient) through ``head`` give
    logits (M, V) scored against teacher rows ``rows`` (M,) (ascending); its mean over the M rows is
    weighted by ``weight`` in the total."""

    hidden: torch.Tensor
    head: nn.Linear
    rows: torch.Tensor
    weight: float


class _HeadLossFunction(torch.autograd.Function):
    """``_head_losses`` as one autograd node: the forward pass computes the losses and their gradients
    chunk by chunk, the backward pass only scales the gradients it kept."""

    @staticmethod
    def forward(ctx, plan: dict, *tensors):
        groups, teacher, ranks, top_k = plan["groups"], plan["teacher"], plan["ranks"], plan["top_k"]
        G, heads = len(groups), plan["heads"]  # heads: the distinct nn.Linear of the groups
        hiddens, params = tensors[:G], tensors[G:]  # params: weight, bias of each distinct head
        device = hiddens[0].device
        # Matmul dtype: autocast's when it is on (train.mixed_precision), else each weight's own.
        amp = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        grads = plan["grads"]  # which of the tensors need a gradient
        differentiable = any(grads)
        with torch.autocast(device.type, enabled=False):
            cast = [None if p is None else p.to(amp or params[2 * (i // 2)].dtype) for i, p in enumerate(params)]
            t_weight = t_bias = None
            if teacher.head is not None:
                t_weight = teacher.head.weight.to(amp or teacher.head.weight.dtype)
                t_bias = None if teacher.head.bias is None else teacher.head.bias.to(t_weight.dtype)
            N = len(teacher)
            vocab = max([teacher.vocab(), *(heads[i].out_features for i in plan["head_of"])])
            C = max(1, plan["chunk_elements"] // vocab)  # teacher rows per chunk; a group has <= C of them
            starts = list(range(0, N, C)) + [N]
            # Where each group's rows fall in the teacher's chunks (rows are ascending): one copy per group.
            rows_host = [g.rows.cpu().numpy() for g in groups]
            bounds = [np.searchsorted(r, starts) for r in rows_host]
            d_hidden = [torch.zeros(h.shape, dtype=torch.float32, device=device) for h in hiddens]  # fp32 sums
            d_params = [torch.zeros(p.shape, dtype=torch.float32, device=device) if need else None
                        for p, need in zip(params, grads[G:])]
            table = torch.zeros(G, 3 + ranks, dtype=torch.float32, device=device)  # loss sum, top1, topk, ranks
            for i in range(len(starts) - 1):
                p_all, p_log_p_all, label_all = teacher.chunk(slice(starts[i], starts[i + 1]), t_weight, t_bias)
                for g, group in enumerate(groups):
                    lo, hi = int(bounds[g][i]), int(bounds[g][i + 1])
                    if lo == hi:
                        continue
                    # This chunk's rows for the group: a slice when they are consecutive (no copy).
                    first = int(rows_host[g][lo]) - starts[i]
                    if rows_host[g][hi - 1] - rows_host[g][lo] == hi - lo - 1:
                        local = slice(first, first + hi - lo)
                    else:
                        local = group.rows[lo:hi] - starts[i]  # (c,)
                    u = plan["head_of"][g]
                    weight, bias = cast[2 * u], cast[2 * u + 1]
                    h = hiddens[g][lo:hi].to(weight.dtype)  # (c, D), e.g. fp32 heads' features into a bf16 head
                    logits = F.linear(h, weight, bias)  # (c, V) in the matmul dtype
                    label = label_all[local]
                    if ranks:  # the rank of the label among the logits, for the sparse tree
                        rank = (logits > logits.gather(-1, label.clamp(min=0)[:, None])).sum(-1)  # (c,)
                        # A label outside the drafter's vocabulary (EAGLE-3: -1) has no rank: never a hit.
                        rank = torch.where(label >= 0, rank, logits.shape[-1])
                        table[g, 1] += (rank == 0).sum()
                        table[g, 2] += (rank < top_k).sum()
                        table[g, 3:] += torch.bincount(rank.clamp(max=ranks), minlength=ranks + 1)[:ranks]
                    else:  # cheap: top-1 and top-k only
                        top1, topk = _top_hits(logits, label, top_k)
                        table[g, 1] += top1
                        table[g, 2] += topk
                    log_q = F.log_softmax(logits, dim=-1, dtype=torch.float32)  # (c, V)
                    del logits
                    # d loss / d logits, in place of log_q once the loss has read it (memory: a chunk holds
                    # the teacher's p, the logits and their log-softmax, and a copy of p's rows at most).
                    if p_all is None:  # cross-entropy with the label: softmax - one_hot
                        table[g, 0] -= log_q.gather(1, label[:, None]).sum()
                        if not differentiable:
                            continue
                        d_logits = log_q.exp_()
                        d_logits[torch.arange(hi - lo, device=device), label] -= 1
                    else:  # KL(p || q) = sum p log p - sum p log q; as F.cross_entropy(logits, p) differentiates
                        p = p_all[local]
                        table[g, 0] += (p_log_p_all[local] - _row_dot(p, log_q)).sum()
                        if not differentiable:
                            continue
                        d_logits = log_q.exp_().sub_(p)  # softmax - p (p sums to 1)
                        del p
                    del log_q
                    d_logits = d_logits.mul_(group.weight / len(group.rows)).to(weight.dtype)  # d total / d logits
                    if grads[g]:
                        d_hidden[g][lo:hi] = d_logits @ weight  # (c, D)
                    if d_params[2 * u] is not None:  # (V, D), summed in fp32
                        if weight.dtype == torch.float32:
                            d_params[2 * u].addmm_(d_logits.T, h)
                        else:
                            d_params[2 * u] += d_logits.T @ h
                    if d_params[2 * u + 1] is not None:
                        d_params[2 * u + 1] += d_logits.float().sum(0)
                    del d_logits
                del p_all
            # A group without rows (nothing of its kind in this batch) has loss 0 and zero gradients.
            table[:, 0] /= torch.tensor([max(1, len(g.rows)) for g in groups], dtype=torch.float32, device=device)
            total = (table[:, 0] * torch.tensor([g.weight for g in groups], dtype=torch.float32, device=device)).sum()
        ctx.mark_non_differentiable(table)
        ctx.save_for_backward(*d_hidden, *(d for d in d_params if d is not None))
        ctx.layout = [d is not None for d in d_params]
        ctx.dtypes = [None if t is None else t.dtype for t in tensors]
        return total, table

    @staticmethod
    def backward(ctx, d_total, d_table):
        saved = list(ctx.saved_tensors)
        G = len(ctx.dtypes) - len(ctx.layout)
        d_hidden, kept = saved[:G], iter(saved[G:])
        d_params = [next(kept) if has else None for has in ctx.layout]
        out = [None if d is None else (d * d_total).to(dtype) for d, dtype in zip(d_hidden + d_params, ctx.dtypes)]
        return (None, *out)


def _head_losses(groups: list[_Group], teacher: _Teacher, *, top_k: int, ranks: int, chunk_elements: int):
    """The drafter's losses against ``teacher``, computed a chunk of positions at a time.

    Returns ``total`` (the sum over groups of weight x mean loss, differentiable with respect to each
    group's hidden states and head parameters) and ``table`` (G, 3 + ranks): each group's mean loss,
    top-1 hits, top-k hits and, with ``ranks``, how often the label has rank 0..ranks-1 (the top-1 and
    top-k hits then count from the ranks). Gradients equal those of the plain formula on full logits."""
    heads: list[nn.Linear] = []
    for g in groups:
        if not any(g.head is h for h in heads):
            heads.append(g.head)
    head_of = [next(i for i, h in enumerate(heads) if h is g.head) for g in groups]
    params = [t for h in heads for t in (h.weight, h.bias)]
    tensors = [*(g.hidden for g in groups), *params]
    grads = [t is not None and t.requires_grad and torch.is_grad_enabled() for t in tensors]
    plan = {"groups": groups, "teacher": teacher, "heads": heads, "head_of": head_of, "grads": grads,
            "top_k": top_k, "ranks": ranks, "chunk_elements": chunk_elements}
    return _HeadLossFunction.apply(plan, *tensors)


def _teacher_rows(selections: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The positions any selection uses, ``need`` (B, S) bool (the teacher's rows are ``x[need]``), and
    each selection's rows among them, (M_i,) long, ascending: selections (B, S) bool, row-major."""
    if not selections:
        return None, []
    need = torch.stack(selections).any(0)  # (B, S)
    row_of = need.flatten().cumsum(0).view(need.shape) - 1  # (B, S)
    return need, [row_of[sel] for sel in selections]


class MedusaObjective(nn.Module):
    """Medusa-1 (frozen target) or Medusa-2 (LoRA on the target, trained jointly).

    Head k at position t reads the target's final hidden state h_t and predicts token t+2+k. Its
    label is the target's own next-token distribution at position t+1+k (``labels: target``, a KL
    loss; top-k accuracy is measured against the target's argmax, which is what greedy verification
    accepts) or the data's token t+2+k (``labels: data``, cross-entropy). Only positions whose
    predicted token is an assistant token count. Head k's loss is weighted by ``head_decay**k``.
    """

    def __init__(self, target_model: nn.Module, config: MedusaConfig, top_k: int, seed: int,
                 chunk_elements: int = LOSS_CHUNK_ELEMENTS):
        super().__init__()
        cfg = target_model.config.get_text_config()
        self.config, self.top_k, self.chunk_elements = config, top_k, chunk_elements
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
                with _gathered([weight]):
                    for head in self.heads.lm_heads:
                        head.weight.data.copy_(weight.detach().float())
        self.heads.float()
        self.feature_layers = feature_layers("medusa", cfg.num_hidden_layers)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters being trained (heads, plus LoRA weights in Medusa-2), by name."""
        return {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}

    load_trainable_state_dict = _load_trainable

    def drafter_module(self, state: dict[str, torch.Tensor] | None = None) -> MedusaHeads:
        """The heads; with ``state`` (full tensors, as ``trainable_state_dict`` names them, e.g. gathered
        from FSDP shards) a new, unsharded copy holding them."""
        if state is None:
            return self.heads
        with torch.random.fork_rng(devices=[]):
            heads = MedusaHeads(*self._heads_args).float()
        heads.load_state_dict(_subtree(state, "heads"))
        return heads

    def _lm_head(self) -> nn.Module:
        return self.target.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                features: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        cfg = self.config
        lm_head = _linear(self._lm_head(), "the target's LM head")
        packed = position_ids is not None
        segments = _segments(position_ids) if packed else None
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
        loss = _zero_loss(self.heads)
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
        need, rows = _teacher_rows([at for _, _, at in chosen])  # need (B, T): the positions u in use
        groups = []
        for (k, sel, _), head_rows in zip(chosen, rows):
            # Every head runs, on zero rows when the batch has none for it (collective safety, _zero_loss).
            # The target's (maybe bf16) state, cast to the heads' fp32 master weights' dtype; then head k's
            # blocks (MedusaHeads.head_logits, less its vocabulary projection, which the loss applies).
            with phase("drafter forward"):
                h = self.heads.blocks[k](hidden[:, :sel.shape[1]][sel].to(heads_dtype))  # (M, D)
            head = self.heads.lm_heads[k] if self.heads.lm_heads is not None else lm_head
            groups.append(_Group(h, head, head_rows, cfg.head_decay ** k))
        if cfg.labels == "target":
            teacher = _Teacher(hidden=hidden.detach()[need], head=lm_head)
        else:
            following = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # (B, T): token u+1 at u
            teacher = _Teacher(labels=following[need])
        with phase("losses"):
            total, table = _head_losses(groups, teacher, top_k=self.top_k, ranks=0 if self.training else R,
                                        chunk_elements=self.chunk_elements)
        loss = loss + total
        tokens = torch.tensor([float(len(g.rows)) for g in groups], device=device)
        stats = {"head_loss": table[:, 0] * tokens, "head_tokens": tokens, "top1": table[:, 1], "topk": table[:, 2],
                 "rank_hits": torch.zeros(K, R, device=device) if self.training else table[:, 3:]}
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
            segments = _segments(position_ids)
            sel = sel & (segments[:, 1:] == segments[:, :-1])
        h = hidden[:, :-1][sel]  # (M, D)
        m = len(h)  # may be 0: the adapter-free forward still runs on every process (collective safety)
        if self.config.lora.lm_loss == "ce":
            teacher = _Teacher(labels=input_ids[:, 1:][sel])
        else:
            with torch.no_grad(), self.target.disable_adapter():
                ref = self.target(input_ids=input_ids, attention_mask=None if position_ids is not None else attention_mask,
                                  position_ids=position_ids, output_hidden_states=True, use_cache=False,
                                  logits_to_keep=1).hidden_states[-1]  # (B, T, D)
            teacher = _Teacher(hidden=ref[:, :-1][sel], head=lm_head)
        rows = torch.arange(m, device=h.device)
        loss, _ = _head_losses([_Group(h, lm_head, rows, 1.0)], teacher, top_k=1, ranks=0,
                               chunk_elements=self.chunk_elements)
        return loss, m

    def merged_target(self) -> nn.Module:
        """The target the heads decode with: the LoRA-merged model in Medusa-2, the frozen one otherwise."""
        if not self.lora:
            return self.target
        import copy

        return copy.deepcopy(self.target).merge_and_unload()


def draft_vocabulary(train_data, vocab_size: int, size: int) -> torch.Tensor:
    """EAGLE-3's draft vocabulary: the ``size`` most frequent assistant tokens of the training data
    (ties by smaller id), padded with the smallest unused ids if fewer distinct tokens occur; (V',)."""
    size = min(size, vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in train_data:
        np.add.at(counts, ids[mask.astype(bool)], 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, then id ascending
    return torch.from_numpy(np.sort(order[:size]).copy())


def _ttt_mask(length: int, step: int, dtype: torch.dtype, device, segments: torch.Tensor | None = None) -> torch.Tensor:
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


class EagleObjective(nn.Module):
    """EAGLE-1: regression of the next feature (smooth L1) + KL of its logits to the target's, with
    noise on the input features. EAGLE-3: KL to the target's distribution over the draft vocabulary,
    unrolled for ``ttt_steps`` on the drafter's own features (training-time test), step j weighted by
    step_decay**j. Stats use "head k" for draft depth k+1 (the unrolled step)."""

    lora = False

    def __init__(self, target_model: nn.Module, kind: str, config, top_k: int, seed: int, train_data=None,
                 chunk_elements: int = LOSS_CHUNK_ELEMENTS):
        super().__init__()
        from selfdraft.heads.eagle import EagleDrafter

        self.kind, self.config, self.top_k, self.chunk_elements = kind, config, top_k, chunk_elements
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
            # Start from the target's head rows and final norm.
            head_weight = target_model.get_output_embeddings().weight
            norm_weight = getattr(getattr(getattr(target_model, "model", None), "norm", None), "weight", None)
            with torch.no_grad(), _gathered([head_weight, norm_weight]):
                if not head_weight.is_meta:  # meta: see MedusaObjective
                    self.drafter.lm_head.weight.copy_(head_weight[ids].float())
                if norm_weight is not None and not norm_weight.is_meta:
                    self.drafter.norm.weight.copy_(norm_weight.float())
        self.steps = 1 if kind == "eagle" else config.ttt_steps
        self.feature_layers = feature_layers(kind, text.num_hidden_layers, self.drafter.dims.get("aux_layers", ()))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Trained parameters plus the drafter's persistent buffers (EAGLE-3's d2t/t2d maps)."""
        state = {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}
        keys = set(self.drafter.state_dict())
        state.update({f"drafter.{n}": b for n, b in self.drafter.named_buffers() if n in keys})
        return state

    load_trainable_state_dict = _load_trainable

    def drafter_module(self, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """The drafter; with ``state`` (full tensors, as ``trainable_state_dict`` names them, e.g. gathered
        from FSDP shards) a new, unsharded copy holding them."""
        if state is None:
            return self.drafter
        from selfdraft.heads.eagle import EagleDrafter

        with torch.random.fork_rng(devices=[]):
            drafter = EagleDrafter(self.drafter.dims).float()
        drafter.load_state_dict(_subtree(state, "drafter"))
        return drafter

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                features: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        from transformers import DynamicCache

        cfg = self.config
        if features is None:
            with phase("target forward"):
                features = target_features(self.target, input_ids, attention_mask, self.feature_layers, position_ids)
        lm_head = _linear(self.target.get_output_embeddings(), "the target's LM head")
        _unshard_units(self.drafter)
        B, T = input_ids.shape
        L = T - 1  # pair positions t = 0..T-2: (feature at t, token t+1)
        device, dtype = input_ids.device, next(self.drafter.parameters()).dtype
        # Held out: how often the label has rank 0..R-1, R the tree's top-k (the predicted acceptance length).
        K, R = self.steps, 1 if self.training else max(1, cfg.tree_top_k)
        stats = {"head_loss": torch.zeros(K, device=device), "head_tokens": torch.zeros(K, device=device),
                 "top1": torch.zeros(K, device=device), "topk": torch.zeros(K, device=device),
                 "rank_hits": torch.zeros(K, R, device=device)}
        loss = _zero_loss(self.drafter)
        if L < 2:  # train.loop.collate pads every batch to MIN_BATCH_LENGTH (3) positions
            raise SelfdraftError(f"EAGLE trains on batches of at least 3 positions, got {T}")
        mask = (loss_mask.bool() & attention_mask.bool())[:, 2:]  # (B, T-2): token t+2 is an assistant token
        # The drafter's inputs in its fp32 master weights' dtype (the target's may be bf16).
        embeds = self.target.get_input_embeddings()(input_ids[:, 1:]).detach().to(dtype)  # (B, L, H)
        if position_ids is None:
            positions, segments = torch.arange(L, device=device)[None].expand(B, L), None
        else:  # packed: pair t belongs to position t's conversation, and token t+2 must too
            positions, segments = position_ids[:, :L], _segments(position_ids)
            mask = mask & (segments[:, 2:] == segments[:, :-2])
            segments = segments[:, :L]
        # The teacher: the target's view of token t+2, its final normed state at t+1 through its LM head,
        # computed by the loss at the supervised positions only.
        target_states = features[:, 1:T - 1, -1]  # (B, T-2, H)
        if self.kind == "eagle":
            feats = features[:, :, -1].to(dtype)  # (B, T, H) final normed features
            x = feats[:, :-1]
            if self.training and cfg.feature_noise > 0:
                x = x + (torch.rand_like(x) * 2 - 1) * cfg.feature_noise
            with phase("drafter forward, step 0"):
                causal = None if segments is None else _ttt_mask(L, 0, dtype, device, segments)
                pred = self.drafter(x, embeds, positions, causal)[:, : T - 2]  # (B, T-2, H) ~ f_{t+1}
            p_hat, f_true = pred[mask], feats[:, 1:T - 1][mask]  # (M, H); M may be 0 (collective safety)
            m = len(p_hat)
            reg = F.smooth_l1_loss(p_hat, f_true, reduction="sum") / max(1, p_hat.numel())  # the mean, 0 if empty
            # EagleDrafter.logits(p_hat, lm_head) == lm_head(p_hat): the target's head, full vocabulary.
            group = _Group(p_hat, lm_head, torch.arange(m, device=device), 1.0)
            with phase("losses"):
                kl, table = _head_losses([group], _Teacher(hidden=target_states[mask], head=lm_head), top_k=self.top_k,
                                         ranks=0 if self.training else R, chunk_elements=self.chunk_elements)
            loss = loss + cfg.regression_weight * reg + cfg.kl_weight * kl
            self._stats(stats, [0], table, [m])
            return loss, stats
        # EAGLE-3: fused features of three layers, unrolled on its own outputs.
        aux = features[:, :-1, :-1].flatten(2).to(dtype)  # (B, L, 3H): the aux layers side by side
        with phase("drafter forward, fuse"):
            feature = self.drafter.fuse(aux)  # (B, L, H)
        marks = [("drafter backward, fuse", feature)]
        draft_ids = self.drafter.draft_to_target()  # (V',)
        # The label is the target's own argmax, as a draft id (-1 when outside the draft vocabulary).
        to_draft = torch.full((self.drafter.vocab_size,), -1, dtype=torch.long, device=device)
        to_draft[draft_ids] = torch.arange(len(draft_ids), device=device)
        cache = DynamicCache(config=self.drafter.layer_config)
        t_index = torch.arange(T - 2, device=device)[None]  # (1, T-2)
        outputs, selections = [], []
        for j in range(K):
            with phase(f"drafter forward, step {j}"):
                step_out = self.drafter(feature, embeds, positions, _ttt_mask(L, j, dtype, device, segments),
                                        cache=cache)  # (B, L, H)
            marks.insert(0, (f"drafter backward, step {j}", step_out))
            # Position t has j own-feature ancestors only if it is at least j into its conversation.
            selections.append(mask & ((t_index if segments is None else positions[:, :T - 2]) >= j))
            outputs.append(step_out)
            feature = torch.cat([torch.zeros_like(step_out[:, :1]), step_out[:, :-1]], dim=1)  # t takes t-1's output
        need, rows = _teacher_rows(selections)  # need == mask (step 0 selects all of it)
        groups = []
        for j, (step_out, sel, step_rows) in enumerate(zip(outputs, selections, rows)):
            # Every step's group, empty ones too (collective safety, _zero_loss).
            # EagleDrafter.logits(x) == lm_head(norm(x)): the norm here, the projection in the loss.
            h = self.drafter.norm(step_out[:, : T - 2][sel])  # (M, H)
            groups.append(_Group(h, self.drafter.lm_head, step_rows, cfg.step_decay ** j))
        # KL to the target's distribution restricted to the draft vocabulary and renormalised there.
        teacher = _Teacher(hidden=target_states[need], head=lm_head, columns=draft_ids, to_label=to_draft)
        with phase("losses"):
            total, table = _head_losses(groups, teacher, top_k=self.top_k, ranks=0 if self.training else R,
                                        chunk_elements=self.chunk_elements)
        if recording() is not None and recording().only is None and torch.is_grad_enabled():
            recording().backward_marks(marks)
        loss = loss + total
        self._stats(stats, list(range(K)), table, [len(g.rows) for g in groups])
        return loss, stats

    def _stats(self, stats, steps: list[int], table: torch.Tensor, tokens: list[int]) -> None:
        with torch.no_grad():
            index = torch.tensor(steps, device=table.device)
            counts = torch.tensor(tokens, dtype=torch.float32, device=table.device)
            stats["head_loss"][index] = table[:, 0] * counts
            stats["head_tokens"][index] = counts
            stats["top1"][index], stats["topk"][index] = table[:, 1], table[:, 2]
            if table.shape[1] > 3:  # rank hits (held out)
                stats["rank_hits"][index] = table[:, 3:]


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
