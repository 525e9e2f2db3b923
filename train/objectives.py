"""Training objectives: the trainable module that the one loop optimises, and the losses they share.

Each drafter kind brings its objective (a :class:`DrafterObjective`, named by its registry entry);
this module holds the interface, :func:`build_objective`, and the machinery every kind's loss is
made of. An objective is an ``nn.Module`` holding the target and the drafter. ``forward(batch)`` takes the
target's features (``feature_layers`` of them) from the batch when they were precomputed, else runs
the frozen target for them (``features.target_features``; Medusa-2 runs its LoRA-adapted target with
gradients), computes the drafter's loss, and returns ``(loss, stats)`` where
``stats`` holds *sums* (per-head loss x tokens, top-1/top-k hits, rank hits, token counts), so that
micro batches and processes aggregate exactly by adding them up.

Batch layout (right-padded): ``input_ids`` (B, T) long, ``attention_mask`` (B, T) long,
``loss_mask`` (B, T) long, 1 on assistant tokens; optional ``features`` (B, T, layers, H), zeros on
padding.

Memory: no (positions x vocabulary) tensor is ever built for a whole batch. Every loss is taken at
the supervised positions only, through ``head_losses``: it projects a chunk of positions at a time
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

from selfdraft.configs.run import RunConfig
from selfdraft.errors import SelfdraftError
from selfdraft.train.budget import BUDGET_EPOCHS, BUDGET_EVIDENCE

LOSS_CHUNK_ELEMENTS = 1 << 24
"""Logits the losses hold at once, positions x vocabulary: a chunk has three or four fp32 tensors of
this size (64 MiB each), 130 positions of a 128k vocabulary, 341 of SmolLM2's 49k."""


def zero_loss(module: nn.Module) -> torch.Tensor:
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


def gathered(params: list[torch.Tensor | None]):
    """Read ``params`` whole inside the context: a target created partitioned under DeepSpeed ZeRO-3
    (``zero3_init_flag``) holds a shard of each weight per process, gathered here and released after."""
    params = [p for p in params if p is not None]
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def load_trainable(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
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


def unshard_units(module: nn.Module) -> None:
    """Gather the FSDP2 units inside ``module`` for this step. FSDP's auto-wrap makes a unit of every
    module of the target's decoder-layer class, the drafter's own layer of that class included, but the
    drafter calls that layer's parts rather than its forward, so the unit's hooks would never gather it.
    Gathered here, it stays so until FSDP's post-backward reduces its gradients and reshards it."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.unshard()


def segments_of(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) conversation number of each position of a packed batch: positions restart at 0 where a
    conversation (or a row's trailing padding) begins (``train.loop.collate``)."""
    return (position_ids == 0).cumsum(-1)


def subtree(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}


def _top_hits(logits: torch.Tensor, label: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How many rows of logits (M, V) rank the label (M,) first, and within the top k."""
    top = logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices  # (M, k)
    return (top[:, 0] == label).sum(), (top == label[:, None]).any(-1).sum()


def as_linear(module: nn.Module, what: str) -> nn.Linear:
    """``module`` as the plain ``nn.Linear`` whose weight the losses project with directly."""
    if not isinstance(module, nn.Linear):
        raise SelfdraftError(f"{what} is a {type(module).__name__}: the losses project with its weight and need a "
                             "plain nn.Linear (for Medusa-2, keep lm_head out of drafter.medusa.lora.target_modules)")
    return module


@dataclasses.dataclass
class Teacher:
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

    def chunk(self, rows: slice, weight: torch.Tensor | None, bias: torch.Tensor | None, mass: bool = False):
        """The teacher at ``rows``: (p (C, V or V') fp32, sum p log p (C,), labels (C,), m) for a KL
        loss, or (None, None, labels (C,), None); ``weight``/``bias``: the LM head's, cast to the matmul
        dtype. With ``mass``, m (C,) is the target's probability of the ``columns`` before p was
        renormalised on them (1 without columns): p * m is the target's own probability there."""
        if self.hidden is None:
            return None, None, self.labels[rows], None
        # The full vocabulary (C, V), in the matmul dtype: the stats need the target's argmax over all
        # of it, and the draft columns are then an index away (cheaper than a second, gathered matmul).
        logits = F.linear(self.hidden[rows].to(weight.dtype), weight, bias)
        label = logits.argmax(-1)
        if self.to_label is not None:
            label = self.to_label[label]
        m = None
        if mass:
            m = torch.ones(len(logits), dtype=torch.float32, device=logits.device)
        if self.columns is not None:
            full = logits.float().logsumexp(-1) if mass else None
            logits = logits[:, self.columns]  # (C, V')
            if mass:
                m = (logits.float().logsumexp(-1) - full).exp()
        log_p = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        del logits
        p = log_p.exp()
        return p, _row_dot(p, log_p), label, m


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(C,) dot products of the rows of a and b (C, V), without a (C, V) product in memory."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).view(-1)


@dataclasses.dataclass
class Group:
    """One loss term: the drafter's features ``hidden`` (M, D) (with gradient) through ``head`` give
    logits (M, V) scored against teacher rows ``rows`` (M,) (ascending); its mean over the M rows is
    weighted by ``weight`` in the total."""

    hidden: torch.Tensor
    head: nn.Linear
    rows: torch.Tensor
    weight: float


class _HeadLossFunction(torch.autograd.Function):
    """``head_losses`` as one autograd node: the forward pass computes the losses and their gradients
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
            overlap = plan["overlap"]
            offsets = np.cumsum([0] + [len(g.rows) for g in groups])
            overlaps = torch.zeros(int(offsets[-1]) if overlap else 0, dtype=torch.float32, device=device)
            for i in range(len(starts) - 1):
                p_all, p_log_p_all, label_all, mass = teacher.chunk(slice(starts[i], starts[i + 1]), t_weight, t_bias,
                                                                    mass=overlap)
                for g, group in enumerate(groups):
                    lo, hi = int(bounds[g][i]), int(bounds[g][i + 1])
                    if lo == hi:
                        continue
                    local = _chunk_rows(rows_host[g], group.rows, lo, hi, starts[i])
                    u = plan["head_of"][g]
                    weight, bias = cast[2 * u], cast[2 * u + 1]
                    h = hiddens[g][lo:hi].to(weight.dtype)  # (c, D), e.g. fp32 heads' features into a bf16 head
                    logits = F.linear(h, weight, bias)  # (c, V) in the matmul dtype
                    label = label_all[local]
                    _count_hits(table[g], logits, label, ranks, top_k)
                    log_q = F.log_softmax(logits, dim=-1, dtype=torch.float32)  # (c, V)
                    del logits
                    soft = p_all is not None  # the teacher's distribution, else its labels
                    d_logits = _loss_and_gradient(
                        table[g], log_q, label, p_all[local] if soft else None, p_log_p_all[local] if soft else None,
                        mass[local] if soft and overlap else None,
                        overlaps[offsets[g] + lo:offsets[g] + hi] if soft and overlap else None, differentiable)
                    del log_q
                    if d_logits is None:
                        continue
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
        ctx.mark_non_differentiable(table, overlaps)
        ctx.save_for_backward(*d_hidden, *(d for d in d_params if d is not None))
        ctx.layout = [d is not None for d in d_params]
        ctx.dtypes = [None if t is None else t.dtype for t in tensors]
        return total, table, overlaps

    @staticmethod
    def backward(ctx, d_total, d_table, d_overlaps):
        saved = list(ctx.saved_tensors)
        G = len(ctx.dtypes) - len(ctx.layout)
        d_hidden, kept = saved[:G], iter(saved[G:])
        d_params = [next(kept) if has else None for has in ctx.layout]
        out = [None if d is None else (d * d_total).to(dtype) for d, dtype in zip(d_hidden + d_params, ctx.dtypes)]
        return (None, *out)


def _chunk_rows(rows_host: np.ndarray, rows: torch.Tensor, lo: int, hi: int, start: int) -> slice | torch.Tensor:
    """A group's rows lo:hi, relative to the teacher chunk that begins at ``start``: a slice when they are
    consecutive (no copy), else an index tensor."""
    first = int(rows_host[lo]) - start
    if rows_host[hi - 1] - rows_host[lo] == hi - lo - 1:
        return slice(first, first + hi - lo)
    return rows[lo:hi] - start  # (c,)


def _count_hits(row: torch.Tensor, logits: torch.Tensor, label: torch.Tensor, ranks: int, top_k: int) -> None:
    """Add a chunk's top-1 and top-k hits to ``row`` (a group's line of the stats table), and with ``ranks``
    the count of each rank of the label among the logits (for the sparse tree)."""
    if ranks:
        rank = (logits > logits.gather(-1, label.clamp(min=0)[:, None])).sum(-1)  # (c,)
        # A label outside the drafter's vocabulary (EAGLE-3: -1) has no rank: never a hit.
        rank = torch.where(label >= 0, rank, logits.shape[-1])
        row[1] += (rank == 0).sum()
        row[2] += (rank < top_k).sum()
        row[3:] += torch.bincount(rank.clamp(max=ranks), minlength=ranks + 1)[:ranks]
    else:  # cheap: top-1 and top-k only
        top1, topk = _top_hits(logits, label, top_k)
        row[1] += top1
        row[2] += topk


def _loss_and_gradient(row: torch.Tensor, log_q: torch.Tensor, label: torch.Tensor, p: torch.Tensor | None,
                       p_log_p: torch.Tensor | None, mass: torch.Tensor | None, overlaps: torch.Tensor | None,
                       differentiable: bool) -> torch.Tensor | None:
    """Add a chunk's summed loss to ``row[0]`` and return d loss / d logits (None when no gradient is
    wanted). Without teacher probabilities ``p`` the loss is the cross-entropy with ``label``; with them,
    KL(p || q). ``overlaps`` (c,) receives sum_v min(p_target(v), q(v)), p_target = p x its ``mass``.
    The gradient is computed in place of ``log_q`` once the loss has read it (memory: a chunk holds the
    teacher's p, the logits and their log-softmax, and a copy of p's rows at most)."""
    if p is None:  # cross-entropy with the label: softmax - one_hot
        row[0] -= log_q.gather(1, label[:, None]).sum()
        if not differentiable:
            return None
        d_logits = log_q.exp_()
        d_logits[torch.arange(len(label), device=log_q.device), label] -= 1
        return d_logits
    # KL(p || q) = sum p log p - sum p log q; as F.cross_entropy(logits, p) differentiates
    row[0] += (p_log_p - _row_dot(p, log_q)).sum()
    if not (differentiable or overlaps is not None):
        return None
    q = log_q.exp_()
    if overlaps is not None:
        overlaps.copy_(torch.minimum(p * mass[:, None], q).sum(-1).clamp_(0, 1))
    if not differentiable:
        return None
    return q.sub_(p)  # softmax - p (p sums to 1)


def head_losses(groups: list[Group], teacher: Teacher, *, top_k: int, ranks: int, chunk_elements: int,
                overlap: bool = False):
    """The drafter's losses against ``teacher``, computed a chunk of positions at a time.

    Returns ``total`` (the sum over groups of weight x mean loss, differentiable with respect to each
    group's hidden states and head parameters) and ``table`` (G, 3 + ranks): each group's mean loss,
    top-1 hits, top-k hits and, with ``ranks``, how often the label has rank 0..ranks-1 (the top-1 and
    top-k hits then count from the ranks). Gradients equal those of the plain formula on full logits.

    With ``overlap`` (a teacher distribution only) a third value, per group (M,) without gradient:
    sum over the drafter's vocabulary of min(p_target(v), q(v)), the probability that the target
    accepts a token drawn from the drafter's distribution there (p_target before any renormalisation
    on ``teacher.columns``), read from the same logits as the loss."""
    if overlap and teacher.hidden is None:
        raise ValueError("head_losses(overlap=True) needs a teacher distribution (Teacher.hidden), not labels")
    heads: list[nn.Linear] = []
    for g in groups:
        if not any(g.head is h for h in heads):
            heads.append(g.head)
    head_of = [next(i for i, h in enumerate(heads) if h is g.head) for g in groups]
    params = [t for h in heads for t in (h.weight, h.bias)]
    tensors = [*(g.hidden for g in groups), *params]
    grads = [t is not None and t.requires_grad and torch.is_grad_enabled() for t in tensors]
    plan = {"groups": groups, "teacher": teacher, "heads": heads, "head_of": head_of, "grads": grads,
            "top_k": top_k, "ranks": ranks, "chunk_elements": chunk_elements, "overlap": overlap}
    total, table, overlaps = _HeadLossFunction.apply(plan, *tensors)
    if not overlap:
        return total, table
    return total, table, list(overlaps.split([len(g.rows) for g in groups]))


def depth_stats(table: torch.Tensor, tokens, depths: int, ranks: int) -> dict[str, torch.Tensor]:
    """The stats of :meth:`DrafterObjective.forward` from :func:`head_losses`' ``table`` (G, 3 + r) and
    each group's scored positions ``tokens`` (G,), group g standing for depth g (G <= ``depths``):
    per depth the loss sum, the positions, top-1 and top-k hits, and (held out, r = ``ranks``) the
    rank hits (depths, ranks); depths without a group are zero."""
    device = table.device
    with torch.no_grad():
        tokens = torch.as_tensor(tokens, dtype=torch.float32, device=device)
        G = len(tokens)
        stats = {name: torch.zeros(depths, device=device) for name in ("head_loss", "head_tokens", "top1", "topk")}
        stats["rank_hits"] = torch.zeros(depths, ranks, device=device)
        stats["head_loss"][:G] = table[:, 0] * tokens
        stats["head_tokens"][:G] = tokens
        stats["top1"][:G], stats["topk"][:G] = table[:, 1], table[:, 2]
        if table.shape[1] > 3:  # rank hits (held out)
            stats["rank_hits"][:G] = table[:, 3:]
    return stats


def draft_vocabulary(train_data, vocab_size: int, size: int) -> torch.Tensor:
    """A reduced draft vocabulary (EAGLE-3, the block drafters): the ``size`` most frequent assistant
    tokens of the training data (ties by smaller id), padded with the smallest unused ids if fewer
    distinct tokens occur; (V',)."""
    size = min(size, vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in train_data:
        np.add.at(counts, ids[mask.astype(bool)], 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, then id ascending
    return torch.from_numpy(np.sort(order[:size]).copy())


def teacher_rows(selections: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The positions any selection uses, ``need`` (B, S) bool (the teacher's rows are ``x[need]``), and
    each selection's rows among them, (M_i,) long, ascending: selections (B, S) bool, row-major."""
    if not selections:
        return None, []
    need = torch.stack(selections).any(0)  # (B, S)
    row_of = need.flatten().cumsum(0).view(need.shape) - 1  # (B, S)
    return need, [row_of[sel] for sel in selections]


class DrafterObjective(nn.Module):
    """What the training loop needs of a kind's objective. A subclass is built as
    ``cls(config, target_model, train_data)`` (``train_data``: the rendered (input_ids, loss_mask)
    pairs, None when the state comes from a checkpoint) and defines ``forward(input_ids,
    attention_mask, loss_mask, features=None, position_ids=None) -> (loss, stats)``, where stats are
    sums (``head_loss``, ``head_tokens``, ``top1``, ``topk`` per depth; ``rank_hits`` (K, R) held out)."""

    lora: bool = False
    """True when the target itself trains (Medusa-2): the loop then gathers it for the export."""
    budget_epochs: float = BUDGET_EPOCHS
    """Epochs over a cached subset that a fixed training budget is spent on
    (:func:`~selfdraft.train.budget.plan_budget`, as the quickstart plans it)."""
    budget_evidence: str = BUDGET_EVIDENCE
    """Why ``budget_epochs``, for the plan's reason."""
    feature_layers: list[int]
    """The target's ``hidden_states`` indices the drafter reads (the last is the final normed state)."""

    def drafter_name(self) -> str:
        """The drafter module's attribute name here: its tensors are ``NAME.*`` in the trainable state."""
        drafter = self.drafter_module()
        return next(n for n, m in self.named_children() if m is drafter)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Trained parameters (and the drafter's persistent buffers) by name: what checkpoints hold."""
        state = {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}
        drafter = self.drafter_module()
        prefix = self.drafter_name()
        keys = set(drafter.state_dict())
        state.update({f"{prefix}.{n}": b for n, b in drafter.named_buffers() if n in keys})
        return state

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_trainable(self, state)

    def drafter_module(self, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """The drafter; with ``state`` (full tensors as ``trainable_state_dict`` names them, e.g.
        gathered from FSDP shards) a new, unsharded copy holding them."""
        raise NotImplementedError

    def decode_defaults(self, rank_accuracy: torch.Tensor | None) -> dict:
        """What a native folder's ``decode`` holds for this drafter, given the held-out rank
        accuracies (K, R) of the last evaluation (None before the first)."""
        raise NotImplementedError

    def predicted_tau(self, rank_accuracy: torch.Tensor) -> float:
        """The acceptance length held-out rank accuracies (K, R) predict for the run's tree."""
        raise NotImplementedError

    def merged_target(self) -> nn.Module:
        """The target the drafter decodes with (Medusa-2: the LoRA-merged model)."""
        return self.target


def build_objective(config: RunConfig, target_model: nn.Module, train_data=None) -> DrafterObjective:
    """The objective of ``config.drafter.kind`` (from the registry) for ``target_model``."""
    from selfdraft.heads.kinds import get_kind

    return get_kind(config.drafter.kind).objective_class()(config, target_model, train_data)


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
