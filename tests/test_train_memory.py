"""The objectives' losses at real vocabularies: computed in chunks of supervised positions, they equal
the plain formula on full logits (loss, gradients, stats), and one training step's peak memory at a
128k vocabulary and 2k tokens stays far below what the full logits take.

``reference_loss`` is the objectives' loss as it was written before chunking (full (B, T, V) target
logits, full (M, V) drafter logits per head or step, autograd through them): the reference both for
values and for memory."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from selfdraft.configs.run import load_run_config
from selfdraft.train.features import target_features
from selfdraft.heads.kinds.medusa.objective import MedusaObjective
from selfdraft.train.objectives import build_objective

KINDS = {
    "medusa-shared-target": [],
    "medusa-shared-data": ["drafter.medusa.labels=data"],
    "medusa-own-target": ["drafter.medusa.own_lm_head=true"],
    "medusa-own-data": ["drafter.medusa.own_lm_head=true", "drafter.medusa.labels=data"],
    "medusa2-kl": ["drafter.medusa.lora.rank=4"],
    "medusa2-ce": ["drafter.medusa.lora.rank=4", "drafter.medusa.lora.lm_loss=ce"],
    "eagle": ["drafter.kind=eagle", "drafter.eagle.feature_noise=0"],
    "eagle3": ["drafter.kind=eagle3"],
}


def _kl(log_p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(p || softmax(logits)), as the objectives wrote it: CE(q, p) - H(p)."""
    return F.cross_entropy(logits, log_p.exp()) + (log_p.exp() * log_p).sum(-1).mean()


def reference_loss(obj, input_ids, attention_mask, loss_mask) -> torch.Tensor:
    """The objective's loss from full logits (no feature noise, every position kept)."""
    B, T = input_ids.shape
    mask = loss_mask.bool() & attention_mask.bool()
    lm_head = obj.target.get_output_embeddings()
    if isinstance(obj, MedusaObjective):
        cfg = obj.config
        if obj.lora:
            out = obj.target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            hidden, target_logits = out.hidden_states[-1], out.logits  # (B, T, D), (B, T, V)
        else:
            hidden = target_features(obj.target, input_ids, attention_mask, obj.feature_layers)[:, :, -1]
            target_logits = lm_head(hidden)
        log_p_all = F.log_softmax(target_logits.detach().float(), dim=-1)  # (B, T, V)
        loss = 0.0
        for k in range(cfg.num_heads):
            n, sel = T - 2 - k, mask[:, 2 + k:]
            logits = obj.heads.head_logits(k, hidden[:, :n][sel].float(), lm_head).float()  # (M, V)
            if cfg.labels == "target":
                head_loss = _kl(log_p_all[:, 1 + k:1 + k + n][sel], logits)
            else:
                head_loss = F.cross_entropy(logits, input_ids[:, 2 + k:][sel])
            loss = loss + cfg.head_decay ** k * head_loss
        if obj.lora and cfg.lora.lm_loss_weight > 0:
            sel = mask[:, 1:]
            log_q = F.log_softmax(target_logits[:, :-1][sel].float(), dim=-1)
            if cfg.lora.lm_loss == "ce":
                lm_loss = F.nll_loss(log_q, input_ids[:, 1:][sel])
            else:
                with torch.no_grad(), obj.target.disable_adapter():
                    ref = obj.target(input_ids=input_ids, attention_mask=attention_mask).logits
                log_p = F.log_softmax(ref[:, :-1][sel].float(), dim=-1)
                lm_loss = F.kl_div(log_q, log_p, log_target=True, reduction="sum") / len(log_q)
            loss = loss + cfg.lora.lm_loss_weight * lm_loss
        return loss
    from transformers import DynamicCache

    from selfdraft.heads.kinds.eagle.objective import ttt_mask as _ttt_mask

    cfg, drafter = obj.config, obj.drafter
    features = target_features(obj.target, input_ids, attention_mask, obj.feature_layers)
    L, mask = T - 1, mask[:, 2:]
    embeds = obj.target.get_input_embeddings()(input_ids[:, 1:]).detach().float()
    positions = torch.arange(L)[None].expand(B, L)
    target_logits = lm_head(features[:, 1:T - 1, -1]).float()  # (B, T-2, V)
    from selfdraft.heads.kinds.eagle.objective import Eagle1Objective

    if isinstance(obj, Eagle1Objective):
        feats = features[:, :, -1].float()
        pred = drafter(feats[:, :-1], embeds, positions, None)[:, :T - 2]
        p_hat = pred[mask]
        reg = F.smooth_l1_loss(p_hat, feats[:, 1:T - 1][mask])
        kl = _kl(F.log_softmax(target_logits[mask], dim=-1), drafter.logits(p_hat, lm_head).float())
        return cfg.regression_weight * reg + cfg.kl_weight * kl
    feature = drafter.fuse(features[:, :-1, :-1].flatten(2).float())
    log_p_all = F.log_softmax(target_logits[..., drafter.draft_to_target()], dim=-1)  # (B, T-2, V')
    cache, loss = DynamicCache(config=drafter.layer_config), 0.0
    for j in range(obj.steps):
        out = drafter(feature, embeds, positions, _ttt_mask(L, j, torch.float32, "cpu"), cache=cache)
        sel = mask & (torch.arange(T - 2)[None] >= j)
        loss = loss + cfg.step_decay ** j * _kl(log_p_all[sel], drafter.logits(out[:, :T - 2][sel]).float())
        feature = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
    return loss


def _setup(kind: str, vocab: int, hidden: int, layers: int, B: int, T: int, draft_vocab: int, chunk: int | None = None,
           supervised: int | None = None):
    """A random Llama target, the objective of ``kind`` on it and a batch with padding and unsupervised
    spans (or, with ``supervised``, only the last that many tokens supervised). ``chunk``: the
    objective's chunk_elements (default: the objectives' own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=max(T, 64))).eval()
    input_ids = torch.randint(0, vocab, (B, T))
    attention_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[:, :T // 8] = 0  # the prompt
    for b in range(1, B):  # shorter rows, right-padded, with another unsupervised span
        attention_mask[b, T - 7 * b:] = 0
        loss_mask[b, T // 2:T // 2 + 5] = 0
    if supervised is not None:
        loss_mask[:, :T - supervised] = 0
    config = load_run_config("smoke_cpu", [*KINDS[kind], f"drafter.eagle.draft_vocab_size={draft_vocab}",
                                           "drafter.medusa.position_fraction=1"])
    data = [(input_ids[b].numpy(), (loss_mask[b] * attention_mask[b]).numpy()) for b in range(B)]
    objective = build_objective(config, target, data)
    if chunk is not None:
        objective.chunk_elements = chunk
    return objective, (input_ids, attention_mask, loss_mask)


def _loss_and_grads(objective, compute):
    objective.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunked_losses_equal_the_full_logits_formula(kind):
    vocab = 1000
    objective, batch = _setup(kind, vocab=vocab, hidden=32, layers=7, B=3, T=40, draft_vocab=300, chunk=7 * vocab)
    objective.train()
    with torch.no_grad():  # Medusa's blocks and LoRA's B start at zero: move every trained weight
        generator = torch.Generator().manual_seed(1)
        for p in objective.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    loss, grads = _loss_and_grads(objective, lambda: objective(*batch)[0])
    want, want_grads = _loss_and_grads(objective, lambda: reference_loss(objective, *batch))
    assert grads.keys() == want_grads.keys() and grads
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    for name in want_grads:
        scale = float(want_grads[name].abs().max())
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-5 * max(scale, 1e-3), msg=name)
    # The stats do not depend on the chunk size (7 positions a chunk here, all at once by default).
    _, small = objective(*batch)
    objective.chunk_elements = 1 << 25
    _, large = objective(*batch)
    for key in small:
        torch.testing.assert_close(small[key], large[key], rtol=1e-5, atol=1e-5, msg=key)
    assert float(small["head_tokens"].sum()) > 0


def test_acceptance_overlap_is_the_targets_probability_of_accepting_a_draw():
    """``head_losses(overlap=True)`` (DSpark's confidence target): per row, sum over the draft vocabulary of
    min(p_target, q), with p_target the target's own probability (not renormalised on the draft
    columns), in chunks of any size; the loss, stats and gradients are those without it."""
    from torch import nn

    from selfdraft.train.objectives import Group, Teacher, head_losses

    generator = torch.Generator().manual_seed(3)
    V, Vd, D = 50, 20, 8
    target_head = nn.Linear(D, V, bias=False)
    draft_head = nn.Linear(D, Vd, bias=False)
    with torch.no_grad():
        target_head.weight.copy_(torch.randn(V, D, generator=generator))
        draft_head.weight.copy_(torch.randn(Vd, D, generator=generator))
    columns = torch.randperm(V, generator=generator)[:Vd].sort().values
    teacher = Teacher(hidden=torch.randn(9, D, generator=generator), head=target_head, columns=columns)
    rows = [torch.tensor([0, 2, 3, 7]), torch.arange(9)]
    hidden = [torch.randn(len(r), D, generator=generator, requires_grad=True) for r in rows]
    for chunk in (V, 3 * V, 100 * V):  # rows split across chunks, and all at once
        groups = [Group(h, draft_head, r, w) for h, r, w in zip(hidden, rows, (1.0, 0.5))]
        total, table, accept = head_losses(groups, teacher, top_k=3, ranks=0, chunk_elements=chunk, overlap=True)
        grads = torch.autograd.grad(total, hidden)
        plain_total, plain_table = head_losses(groups, teacher, top_k=3, ranks=0, chunk_elements=chunk)
        plain_grads = torch.autograd.grad(plain_total, hidden)
        torch.testing.assert_close(total, plain_total)
        torch.testing.assert_close(table, plain_table)
        for g, want in zip(grads, plain_grads):
            torch.testing.assert_close(g, want)
        with torch.no_grad():
            p = F.softmax(target_head(teacher.hidden), -1)[:, columns]  # the target's own, on the draft columns
            for h, r, got in zip(hidden, rows, accept):
                q = F.softmax(draft_head(h), -1)
                torch.testing.assert_close(got, torch.minimum(p[r], q).sum(-1), rtol=1e-5, atol=1e-6)
                assert not got.requires_grad and bool((got > 0).all() and (got < 1).all())


# ----------------------------------------------------------------------------------------------
# Peak memory of one training step at a 128k vocabulary

MEMORY_SHAPE = {"vocab": 128256, "hidden": 64, "layers": 2, "B": 1, "T": 2048, "draft_vocab": 32000, "supervised": 512}
MEASURED = [("eagle3", False), ("medusa-shared-target", False), ("eagle3", True)]
"""What one subprocess measures, in this order: each chunked step in a fresh process, the full-logits
reference last (memory its predecessors freed may serve it again, which can only understate it)."""


def _rss_kb() -> tuple[int, int]:
    """(resident, peak resident) KiB of this process."""
    status = dict(line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


def measure_steps() -> list[dict]:
    """For each of MEASURED: build the objective at MEMORY_SHAPE, run one step (the target's features,
    the loss, its backward) and record how far the peak resident memory rose above the memory before
    the step, in MiB. torch's CPU tensors are plain malloc/mmap memory, so the kernel's peak RSS (VmHWM,
    reset through /proc/self/clear_refs) sees them all, and every tensor the size of a chunk (64 MiB)
    or more is a fresh mmap that shows up whatever memory the process kept from before."""
    import gc

    results = []
    for kind, reference in MEASURED:
        objective, batch = _setup(kind, **MEMORY_SHAPE)
        objective.train()
        gc.collect()
        before, _ = _rss_kb()
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        loss = reference_loss(objective, *batch) if reference else objective(*batch)[0]
        loss.backward()
        _, peak = _rss_kb()
        results.append({"kind": kind, "reference": reference, "peak_mib": (peak - before) / 1024, "loss": float(loss)})
        del objective, batch, loss
    return results


@pytest.mark.slow
@pytest.mark.skipif(not pathlib.Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_one_step_at_a_128k_vocabulary_stays_far_below_the_full_logits(capsys):
    """EAGLE-3 (draft vocabulary 32k) against the full-logits formula, measured; Medusa (3 heads) against
    the fp32 logits the full formula must hold at least (measuring it would take several GB more)."""
    script = ("import importlib.util, json\n"
              f"spec = importlib.util.spec_from_file_location('memory_test', {str(pathlib.Path(__file__))!r})\n"
              "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n"
              "print(json.dumps(module.measure_steps()))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    eagle3, medusa, eagle3_full = json.loads(proc.stdout.strip().splitlines()[-1])
    shape = MEMORY_SHAPE
    # The full formula holds at least the target's fp32 log-probabilities at every position and each
    # head's (M, V) fp32 logits.
    medusa_full_floor = 4 * shape["vocab"] * (shape["B"] * shape["T"] + 3 * shape["supervised"]) / 2 ** 20
    with capsys.disabled():
        print(f"\npeak memory of one step, vocab {shape['vocab']}, {shape['B']} x {shape['T']} tokens, "
              f"{shape['supervised']} supervised: EAGLE-3 chunked {eagle3['peak_mib']:.0f} MiB, full logits "
              f"{eagle3_full['peak_mib']:.0f} MiB; Medusa chunked {medusa['peak_mib']:.0f} MiB, full logits "
              f">= {medusa_full_floor:.0f} MiB")
    assert abs(eagle3["loss"] - eagle3_full["loss"]) < 1e-4 * abs(eagle3_full["loss"])
    assert eagle3["peak_mib"] < eagle3_full["peak_mib"] / 4
    assert medusa["peak_mib"] < medusa_full_floor / 4
