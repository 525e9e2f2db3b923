"""DFlash and DSpark (the block kinds): labels aligned with the target's features position by position,
training through the one loop, native export, and decoding that keeps the target's output exact.
Tiny random targets with the embedded tokenizer; the real target's checks are in the engine tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from selfdraft.configs.run import load_run_config
from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims, default_target_layers

KINDS = ["dflash", "dspark"]


def block_config(tiny_target, out, kind, *overrides):
    return load_run_config("smoke_cpu", [
        f"target.spec={tiny_target}", f"train.output_dir={out}", f"drafter.kind={kind}", "data.max_conversations=24",
        "data.max_length=64", "data.eval_fraction=0.2", "train.micro_batch_size=2", "train.grad_accum=1",
        "train.max_steps=4", "train.eval_every=2", "train.eval_batches=2", "train.save_every=2", "train.lr=3e-3",
        "drafter.block.block_size=4", "drafter.block.anchors=8", "drafter.block.draft_vocab_size=512",
        "drafter.block.markov_rank=8", *overrides])


def random_batch(vocab: int, avoid: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 40), generator=g)
    ids[ids == avoid] = 0
    attention = torch.ones_like(ids)
    attention[1, 33:] = 0  # a padded row
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 10:25] = 1
    loss_mask[0, 30:40] = 1
    loss_mask[1, 5:33] = 1
    return ids, attention, loss_mask


@pytest.mark.parametrize("kind", KINDS)
def test_labels_and_teacher_rows_line_up_with_the_targets_features(kind, tiny_target, tmp_path):
    """Every scored (anchor a, drafted j) is x_{a+1+j}: supervised, in the anchor's conversation, the
    prefix of its block supervised too; the teacher's row is the target's own prediction of that token
    (its logits at position a+j); held-out anchors are the same in every evaluation."""
    from selfdraft.heads.target import load_target
    from selfdraft.train.objectives import build_objective

    target = load_target(str(tiny_target))
    config = block_config(tiny_target, tmp_path, kind)
    vocab = target.model.config.vocab_size
    data = [(torch.randint(0, vocab - 1, (30,)).numpy(), torch.ones(30, dtype=torch.long).numpy())]
    objective = build_objective(config, target.model, data).eval()
    ids, attention, loss_mask = random_batch(vocab, objective.drafter.mask_token_id)
    plan = objective.plan(ids, attention, loss_mask)
    logits = target.model(input_ids=ids, attention_mask=attention).logits  # (B, T, V)
    features = plan.features
    K = objective.steps
    assert K == (3 if kind == "dflash" else 4)
    scored = 0
    for b in range(2):
        for i, a in enumerate(plan.anchor[b].tolist()):
            for j in range(K):
                if not plan.ok[b, i, j]:
                    assert not plan.ok[b, i, j:].any(), "a block's scored positions are its supervised prefix"
                    continue
                scored += 1
                label = a + 1 + j
                assert plan.label_at[b, i, j] == label and loss_mask[b, label] == 1 and attention[b, label] == 1
                assert all(loss_mask[b, a + 1 + k] == 1 for k in range(j))
                teacher = target.model.get_output_embeddings()(features[b, label - 1, -1])
                torch.testing.assert_close(teacher, logits[b, label - 1], rtol=1e-4, atol=1e-4)
    assert scored > 10
    again = objective.plan(ids, attention, loss_mask)
    assert torch.equal(again.anchor, plan.anchor) and torch.equal(again.ok, plan.ok)


@pytest.mark.parametrize("kind", KINDS)
def test_a_trained_block_drafter_decodes_exactly(kind, tiny_target, tmp_path):
    """Through the one loop (with an interruption and a resume that continues bit for bit), then
    native export; greedy output equals the target's generate(), token for token, whole blocks verified
    and blocks cut by a confidence schedule."""
    import json

    from safetensors.torch import load_file

    from selfdraft.heads.io import load_drafter
    from selfdraft.heads.target import load_target
    from selfdraft.configs.decode import DecodeConfig
    from selfdraft.inference.api import generate
    from selfdraft.inference.decode import speculative_decode
    from selfdraft.inference.costs import CostSurface
    from selfdraft.inference.policy import Adaptive
    from selfdraft.inference.session import CausalLMSession
    from selfdraft.inference.specs import make_drafter
    from selfdraft.train.loop import train

    result = train(block_config(tiny_target, tmp_path / "run", kind))
    module, record = load_drafter(result.drafter_dir)
    assert record.kind == kind and isinstance(module, BlockHead)
    dims = record.dims
    assert isinstance(dims, DSparkDims if kind == "dspark" else DFlashDims)
    assert dims.target_layers == tuple(default_target_layers(7)) == (2, 3, 5)
    assert (module.markov_head is not None) == (kind == "dspark")
    evaluation = json.loads((result.drafter_dir / "config.json").read_text())["evaluation"]
    assert len(evaluation["top1"]) == dims.drafts_per_block

    cut = tmp_path / "cut"
    train(block_config(tiny_target, cut, kind), stop_after=2)
    resumed = train(block_config(tiny_target, cut, kind), resume=True)
    a = load_file(result.drafter_dir / "model.safetensors")
    b = load_file(resumed.drafter_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resume did not continue bit for bit"

    target = load_target(str(tiny_target))
    ids = target.tokenizer("The quick brown fox", add_special_tokens=True)["input_ids"]
    reference = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      do_sample=False, max_new_tokens=32, pad_token_id=0)[0, len(ids):].tolist()
    out = generate(target, input_ids=ids, drafter=str(result.drafter_dir), max_new_tokens=32, stop_on_eos=False,
                   policy="fixed")
    assert out.token_ids == reference and out.drafter == kind
    assert out.draft_nodes_per_step == pytest.approx(dims.drafts_per_block, abs=1.0)
    # Branching where the drafter is unsure: a tree of 2 x the block's drafts from the same forward.
    trees = []
    branching = make_drafter(str(result.drafter_dir), target, tree={"top_k": 2})
    propose = branching.propose_batch
    branching.propose_batch = lambda states, sequences: [trees.append(t) or (t, s) for t, s in propose(states, sequences)]
    out = generate(target, input_ids=ids, drafter=branching, max_new_tokens=32, stop_on_eos=False, policy="fixed")
    assert out.token_ids == reference and branching.max_nodes == 2 * dims.drafts_per_block
    assert trees and all(t.num_nodes == branching.max_nodes and len(set(t.parent_ids)) < t.num_nodes for t in trees)

    # Confidence-scheduled: cut at lengths that vary with the drafter's confidence, exact all the same.
    drafter = make_drafter(str(result.drafter_dir), target)
    assert drafter.max_nodes == dims.drafts_per_block
    verified = set()
    for per_token in (0.0, 0.00005, 0.0005, 0.005):
        trees = []

        class Recording(Adaptive):  # the value cut alone, recording what it verifies
            def run(self, rows):
                run = super().run(rows)
                verify = run.verify
                run.verify = lambda proposed, seconds: [trees.append(t.num_nodes) or t for t in verify(proposed, seconds)]
                return run

        cost = CostSurface.row(tuple(0.01 + per_token * m for m in range(1, 9)), target="t", dtype="float32", device="cpu", context=256)
        session = CausalLMSession(target.model, hidden_layers=drafter.hidden_layers)
        scheduled = speculative_decode(session, ids, drafter, DecodeConfig(max_new_tokens=32, stop_on_eos=False),
                                       policy=Recording(cost, 0.0, gate=False))
        assert scheduled.token_ids == reference, f"scheduled at {per_token} s per token: not the target's output"
        assert scheduled.stats.draft_nodes == sum(trees) <= scheduled.stats.proposed_nodes
        verified.update(trees)
    assert len(verified) >= 2, f"the schedule never varied the verified length ({verified}): the check proves little"


@pytest.mark.parametrize("kind", KINDS)
def test_block_drafts_that_the_target_would_make_are_all_accepted(kind, tiny_target):
    """A drafter whose every draft is the target's own next token (its logits replaced by the target's,
    fed the true prefix) is accepted whole: tau = block drafts + 1 wherever the answer is long enough.
    This is what proves the alignment in decoding: an off-by-one anchor or position would reject."""
    from selfdraft.heads.kinds.block.decode import BlockDrafter
    from selfdraft.heads.target import load_target
    from selfdraft.inference.api import generate
    from selfdraft.configs.decode import TreeConfig

    target = load_target(str(tiny_target))
    text = target.model.config
    dims_class = DSparkDims if kind == "dspark" else DFlashDims
    extra = {"markov_rank": 4} if kind == "dspark" else {}
    dims = dims_class.shaped_like(text, block_size=4, num_layers=1, draft_vocab_size=text.vocab_size,
                                  mask_token_id=text.vocab_size - 1, target_layers=(2, 4, 6), **extra)
    drafter = BlockDrafter(BlockHead(dims), target.model, TreeConfig(depth=8, top_k=1, max_nodes=8))

    def oracle(out, anchors):  # the block's drafts as the target itself continues the sequence
        assert out.shape[0] == len(anchors) == 1  # one row: generate() decodes one sequence
        sequence = oracle.sequence
        assert int(anchors[0]) == sequence[-1]
        more = target.model.generate(torch.tensor([sequence]), attention_mask=torch.ones(1, len(sequence), dtype=torch.long),
                                     do_sample=False, max_new_tokens=out.shape[1], pad_token_id=0)
        drafts = more[:, len(sequence):]
        return drafts, torch.ones(drafts.shape)  # certain of each: a schedule would verify them all

    propose = drafter.propose

    def recording_propose(state, sequence):
        oracle.sequence = list(sequence)
        return propose(state, sequence)

    drafter._draft, drafter.propose = oracle, recording_propose
    ids = target.tokenizer("Once upon a time", add_special_tokens=True)["input_ids"]
    steps = 3  # after the prefill's token, each step accepts the whole block and adds the target's bonus token
    new = 1 + steps * (dims.drafts_per_block + 1)
    # policy fixed: the oracle's proposal runs the target's own generate(), so it costs several target forwards,
    # which the adaptive policy rightly never pays for (even a block that is always accepted would lose)
    out = generate(target, input_ids=ids, drafter=drafter, max_new_tokens=new, stop_on_eos=False, policy="fixed")
    assert out.acceptance_length == pytest.approx(new / (1 + steps))


def test_bad_block_settings_name_the_fix(tiny_target, tmp_path):
    from selfdraft.heads.target import load_target
    from selfdraft.train.objectives import build_objective

    target = load_target(str(tiny_target))
    text = target.model.config
    data = [(torch.tensor([5, 6, 7, 8]).numpy(), torch.ones(4, dtype=torch.long).numpy())]
    with pytest.raises(SelfdraftError, match="mask_token_id 7 is a token of the training data"):
        build_objective(block_config(tiny_target, tmp_path, "dflash", "drafter.block.mask_token_id=7"), target.model, data)
    with pytest.raises(SelfdraftError, match="outside the target's vocabulary"):
        build_objective(block_config(tiny_target, tmp_path, "dflash", f"drafter.block.mask_token_id={text.vocab_size}"),
                        target.model, data)
    with pytest.raises(SelfdraftError, match="target_layers"):
        build_objective(block_config(tiny_target, tmp_path, "dspark", "drafter.block.target_layers=[3,3]"), target.model, data)
    with pytest.raises(SelfdraftError, match="target_layers"):
        build_objective(block_config(tiny_target, tmp_path, "dspark", "drafter.block.target_layers=[2,7]"), target.model, data)
    with pytest.raises(SelfdraftError, match="block_size"):
        block_config(tiny_target, tmp_path, "dflash", "drafter.block.block_size=64")
    good = DFlashDims.shaped_like(text, block_size=4, num_layers=1, draft_vocab_size=64, mask_token_id=3, target_layers=(2, 4))
    with pytest.raises(SelfdraftError, match="block_size 600 exceeds the context"):
        dataclasses.replace(good, block_size=600)
    with pytest.raises(SelfdraftError, match="markov_rank"):
        DSparkDims.shaped_like(text, block_size=4, num_layers=1, draft_vocab_size=64, mask_token_id=3, target_layers=(2, 4),
                               markov_rank=0)


def test_default_layers_and_mask_token_on_shallow_targets_and_list_eos():
    """The defaults hold on any target: distinct layers below the last (the middle one alone under 6
    layers), and a mask token chosen past a list of eos ids (Llama 3.1's config has three)."""
    import types

    from selfdraft.heads.kinds.block.objective import choose_mask_token

    for layers in range(2, 40):
        chosen = default_target_layers(layers)
        assert chosen == sorted(set(chosen)) and all(1 <= i < layers for i in chosen), (layers, chosen)
    assert default_target_layers(32) == [2, 16, 30]
    config = types.SimpleNamespace(vocab_size=10, bos_token_id=0, eos_token_id=[9, 8], pad_token_id=None)
    assert choose_mask_token(config, [([1, 2, 7], [0, 1, 1])], None) == 6
