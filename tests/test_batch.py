"""Batched decoding (inference/batch.py): several prompts in one target forward per step, each row with
its own tree, cache validity and acceptance, exact per row.

Greedy: every row equals transformers' generate() and its own batch-1 output, for every drafter kind,
prompts of different lengths, rows that stop early (EOS, the context) and a batch that shrinks as they
leave. Batched drafters (the block kinds, EAGLE-1 and EAGLE-3) draft each row's own tree, in one drafter
forward for the batch (per depth, for EAGLE). Sampled: each row equals its own batch-1 output under the same seed (the batch-1 loop's law is
what test_sampling_exact.py checks; the chi-square harness per row of a batch is there too).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from selfdraft.configs.decode import DRAFT_MODEL_TREE, DecodeConfig, PromptLookupConfig
from selfdraft.errors import SelfdraftError
from selfdraft.inference.batch import BatchSession
from selfdraft.inference.decode import batched_decode
from selfdraft.inference.decode import speculative_decode
from selfdraft.inference.drafters import DraftModelDrafter, Drafter, NoDrafter, PromptLookupDrafter, Verified
from selfdraft.inference.hybrid import CopyDrafter, HybridDrafter
from selfdraft.inference.policy import Adaptive, Profile
from selfdraft.inference.session import CausalLMSession
from selfdraft.inference.tree import DraftTree

PROMPTS = [[5, 17, 3, 88, 41, 5, 17, 3, 60, 2, 9, 5, 17, 3], [7], [40, 41, 42, 40, 41], [11, 12, 13, 14, 15, 16, 17, 11, 12]]


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(0)


def random_eagle(target, kind: str, tree):
    """A seeded random EAGLE-1 (``kind="eagle"``) or EAGLE-3 (a draft vocabulary of 60) drafter of ``target``."""
    from selfdraft.heads.kinds.eagle import new_drafter
    from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter

    torch.manual_seed(5)
    module = new_drafter(target, kind, draft_vocab_size=60 if kind == "eagle3" else None)
    if kind == "eagle3":
        module.set_vocab_map(torch.randperm(target.config.vocab_size)[:60])
    return EagleTreeDrafter(module.eval(), target, tree)


@pytest.fixture(scope="module")
def drafters(target, tiny_llama, random_kind_drafters):
    from selfdraft.configs.decode import TreeConfig

    draft = tiny_llama(1, layers=1, hidden=32)
    kinds = random_kind_drafters(target)
    return {
        "eagle": random_eagle(target, "eagle", TreeConfig(depth=3, top_k=2, max_nodes=4)),
        "none": NoDrafter(),
        "prompt-lookup": PromptLookupDrafter(PromptLookupConfig(max_branches=2, num_tokens=4, max_nodes=8, min_ngram=1)),
        "draft-model": DraftModelDrafter(draft, dataclasses.replace(DRAFT_MODEL_TREE, depth=3, top_k=2, max_nodes=6)),
        "self-draft": DraftModelDrafter(target, dataclasses.replace(DRAFT_MODEL_TREE, depth=4, top_k=2, max_nodes=8)),
        "copy": CopyDrafter(),
        "hybrid-eagle3": HybridDrafter(kinds["eagle3"], CopyDrafter()),
        **kinds,
    }


def reference(model, prompt, n):
    x = torch.tensor([prompt])
    return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()


def test_every_row_is_greedy_exact_with_every_drafter(target, drafters):
    """Each row of a batch of 4 prompts (1 to 14 tokens) equals generate() and its own batch-1 output, for
    every drafter; the self-drafting target accepts long paths, so rows commit different token counts per
    step (the cache's holes), and the batch statistics are each row's own."""
    n = 32
    refs = [reference(target, p, n) for p in PROMPTS]
    config = DecodeConfig(max_new_tokens=n)
    for name, drafter in drafters.items():
        session = BatchSession(target, hidden_layers=drafter.hidden_layers)
        outs = batched_decode(session, PROMPTS, drafter, config)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            assert out.token_ids == ref, f"{name}, row {i}: first divergence at " \
                f"{next(j for j, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)}"
            alone = speculative_decode(CausalLMSession(target, hidden_layers=drafter.hidden_layers), PROMPTS[i], drafter,
                                       config)
            assert out.stats.target_forwards == alone.stats.target_forwards, (name, i)
            assert out.stats.accept_histogram == alone.stats.accept_histogram, (name, i)
        if name == "self-draft":
            assert all(n / out.stats.target_forwards > 2.5 for out in outs), [o.stats.target_forwards for o in outs]


def test_rows_that_stop_early_leave_the_batch_and_the_rest_stay_exact(target, drafters):
    """An EOS token that some rows emit early and others never, and a context that the longest prompt
    reaches first: each row stops for its own reason at its own step, and the rows left go on exactly."""
    n = 30
    refs = [reference(target, p, n) for p in PROMPTS]
    eos = refs[2][4]  # row 2 stops at its fifth token; the other rows stop where they emit it, if they do
    config = DecodeConfig(max_new_tokens=n)
    context = len(PROMPTS[0]) + 12
    for name in ("none", "prompt-lookup", "self-draft", "eagle3"):
        drafter = drafters[name]
        outs = batched_decode(BatchSession(target, hidden_layers=drafter.hidden_layers), PROMPTS, drafter, config,
                              eos_token_ids=[eos], max_context=context)
        for i, out in enumerate(outs):
            alone = speculative_decode(CausalLMSession(target, hidden_layers=drafter.hidden_layers), PROMPTS[i], drafter,
                                       config, eos_token_ids=[eos], max_context=context)
            assert (out.token_ids, out.stop_reason) == (alone.token_ids, alone.stop_reason), (name, i)
        assert outs[2].stop_reason == "eos" and len(outs[2].token_ids) <= 5
        assert outs[0].stop_reason == "context" or eos in outs[0].token_ids


def test_the_node_budget_follows_the_live_batch_size(target, drafters):
    """A profile policy's node budget: no drafting while 3 rows are live, 2 nodes per row once one has left (it stops
    at an EOS token early); the rows stay exact, and the steps drafted and skipped say which applied."""
    n = 24
    refs = [reference(target, p, n) for p in PROMPTS[:3]]
    eos = next(t for t in refs[2][3:] if t not in refs[0] + refs[1] + refs[2][:3])  # row 2 alone stops, early
    seen = []

    def budget(rows):
        seen.append(rows)
        return 0 if rows >= 3 else 2

    config = DecodeConfig(max_new_tokens=n)
    drafter = drafters["self-draft"]
    outs = batched_decode(BatchSession(target), PROMPTS[:3], drafter, config, eos_token_ids=[eos], policy=Profile(budget))
    for i, out in enumerate(outs):
        alone = speculative_decode(CausalLMSession(target), PROMPTS[i], drafter, config, eos_token_ids=[eos])
        assert out.token_ids == alone.token_ids, i
        s = out.stats
        assert s.drafted_steps + s.skipped_steps == s.target_forwards - 1
        assert s.draft_nodes <= 2 * s.drafted_steps
    assert seen[0] == 3 and 2 in seen
    assert outs[2].stop_reason == "eos" and outs[2].stats.drafted_steps == 0 and outs[2].stats.skipped_steps > 0
    going = [out for out in outs if out.stop_reason != "eos" or len(out.token_ids) > len(outs[2].token_ids)]
    assert going and all(out.stats.drafted_steps > 0 and out.stats.skipped_steps > 0 for out in going)


def test_sampled_rows_equal_their_batch_one_runs_under_the_same_seed(target, drafters):
    """Temperature 1 with top-p, a seed per row: each row's tokens equal the same prompt decoded alone with
    that seed, so the batch keeps the batch-1 loop's (lossless) law row by row."""
    config = DecodeConfig(max_new_tokens=24, temperature=1.0, top_p=0.9)
    seeds = [11, 12, 13, 14]
    for name in ("none", "prompt-lookup", "draft-model", "dflash", "eagle3"):
        drafter = drafters[name]
        outs = batched_decode(BatchSession(target, hidden_layers=drafter.hidden_layers), PROMPTS, drafter, config,
                              seeds=seeds)
        for i, out in enumerate(outs):
            alone = speculative_decode(CausalLMSession(target, hidden_layers=drafter.hidden_layers), PROMPTS[i], drafter,
                                       dataclasses.replace(config, seed=seeds[i]))
            assert out.token_ids == alone.token_ids, (name, i)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_block_drafter_drafts_a_whole_batch_in_one_forward(target, drafters, kind):
    """The block drafters' ``propose_batch``: one drafter forward for rows whose contexts differ in length
    (1 to 14 positions, the padding masked) drafts each row's own block: the tokens its proposal alone
    drafts, with the same values; as a chain and branching (a tree of 6 nodes from the same forward)."""
    from selfdraft.configs.decode import TreeConfig
    from selfdraft.heads.kinds.block.decode import BlockDrafter

    chain = drafters[kind]
    assert chain.batched and not drafters["medusa"].batched
    branching = BlockDrafter(chain.drafter, target, TreeConfig(depth=3, top_k=2, max_nodes=6))
    for drafter in (chain, branching):
        states, sequences = [], []
        for p in PROMPTS:
            session = CausalLMSession(target, hidden_layers=drafter.hidden_layers)
            states.append(drafter.start(p, session.prefill(p)))
            sequences.append(p + [p[0]])
        alone = [drafter.propose(state, sequence) for state, sequence in zip(states, sequences)]
        calls = []
        hook = drafter.drafter.register_forward_hook(lambda module, args, out: calls.append(out.shape[0]))
        try:
            batch = drafter.propose_batch(states, sequences)
        finally:
            hook.remove()
        assert calls == [len(PROMPTS)]
        for (one, _), (row, state) in zip(alone, batch):
            assert row.token_ids == one.token_ids and row.parent_ids == one.parent_ids
            assert row.num_nodes == drafter.max_nodes and max(row.depths()) <= drafter.drafts
            assert row.values == pytest.approx(one.values, abs=1e-5)
            assert state.length == len(state.context[0][0])  # each row's state keeps its own context
        if drafter is branching:
            assert all(len(set(row.parent_ids)) < row.num_nodes for row, _ in batch)  # a tree, not a chain


def committed(target, drafter, sequence, tree, accepted: int) -> tuple[list[int], Verified]:
    """A verification step that accepted up to ``accepted`` nodes along ``tree``'s first path below the
    root ``sequence[-1]`` and the bonus token 1: the new sequence, and what the drafter observes (the
    target's features at the root and the accepted positions)."""
    path, node = [], -1
    while len(path) < accepted and node in tree.parent_ids:
        node = tree.parent_ids.index(node)  # the first child of the last node taken
        path.append(tree.token_ids[node])
    accepted = len(path)
    out = CausalLMSession(target, hidden_layers=drafter.hidden_layers).prefill(sequence + path)
    return sequence + path + [1], Verified(path + [1], tuple(h[-(accepted + 1):] for h in out.hidden))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_an_eagle_drafter_drafts_a_whole_batch_in_one_forward_per_depth(target, kind):
    """EAGLE's ``propose_batch``: rows with contexts of 1-14 positions and different pending features (the
    whole prompt at the first step, 1-4 accepted positions at the second) catch up in one drafter forward
    and grow their trees in one forward per depth; each row's tree is the one its own ``propose`` grows
    (tokens, parents, values), and each row's state holds its committed positions only, so the next
    step continues it exactly as the row's own proposals do."""
    from selfdraft.configs.decode import TreeConfig

    drafter = random_eagle(target, kind, TreeConfig(depth=4, top_k=3, max_nodes=10))
    assert drafter.batched
    sequences, alone_states, batch_states = [], [], []
    for p in PROMPTS:
        prefill = CausalLMSession(target, hidden_layers=drafter.hidden_layers).prefill(p)
        alone_states.append(drafter.start(p, prefill))
        batch_states.append(drafter.start(p, prefill))
        sequences.append(p + [p[0]])
    for step in range(2):
        assert len({s.pending.shape[0] for s in batch_states}) > 1  # pending features differ from row to row
        alone = [drafter.propose(state, sequence) for state, sequence in zip(alone_states, sequences)]
        calls = []
        hook = drafter.drafter.register_forward_hook(lambda module, args, out: calls.append(out.shape[:2]))
        try:
            batch = drafter.propose_batch(batch_states, sequences)
        finally:
            hook.remove()
        most = max(s.pending.shape[0] for s in batch_states)
        assert calls == [(len(PROMPTS), most)] + [(len(PROMPTS), 3)] * 3, calls  # catch-up, then k nodes per depth
        for (one, one_state), (row, state), sequence in zip(alone, batch, sequences):
            assert row.token_ids == one.token_ids and row.parent_ids == one.parent_ids, step
            assert row.num_nodes == 10 and row.values == pytest.approx(one.values, rel=1e-4, abs=1e-8)
            assert state.length == one_state.length == len(sequence) - 1 == state.cache.get_seq_length()
            torch.testing.assert_close(state.cache.layers[0].keys, one_state.cache.layers[0].keys, atol=1e-5, rtol=1e-5)
        steps = [committed(target, drafter, sequence, tree, accepted=i % 4)
                 for i, (sequence, (tree, _)) in enumerate(zip(sequences, alone))]
        sequences = [sequence for sequence, _ in steps]
        alone_states = [drafter.observe(state, v) for (_, state), (_, v) in zip(alone, steps)]
        batch_states = [drafter.observe(state, v) for (_, state), (_, v) in zip(batch, steps)]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_batches_with_an_eagle_drafter_draft_in_lockstep_and_stay_exact(target, kind):
    """Batched decoding with an EAGLE drafter of a wide tree (its random drafts are accepted now and then,
    so rows commit different counts and catch up on different numbers of features): every row equals
    generate() and its own batch-1 run (tokens, forwards, acceptances), and the drafter ran ``depth``
    forwards per step for the whole batch, not per row."""
    from selfdraft.configs.decode import TreeConfig

    n = 24
    drafter = random_eagle(target, kind, TreeConfig(depth=3, top_k=6, max_nodes=16))
    calls = []
    hook = drafter.drafter.register_forward_hook(lambda module, args, out: calls.append(out.shape[0]))
    try:
        outs = batched_decode(BatchSession(target, hidden_layers=drafter.hidden_layers), PROMPTS, drafter,
                              DecodeConfig(max_new_tokens=n))
    finally:
        hook.remove()
    accepted = 0
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference(target, prompt, n)
        alone = speculative_decode(CausalLMSession(target, hidden_layers=drafter.hidden_layers), prompt, drafter,
                                   DecodeConfig(max_new_tokens=n))
        assert (out.stats.target_forwards, out.stats.accept_histogram) == (alone.stats.target_forwards,
                                                                           alone.stats.accept_histogram)
        accepted += n - out.stats.target_forwards
    assert accepted > 0  # some steps accepted drafts: the rows' pending counts differed
    assert len(calls) == 3 * max(out.stats.drafted_steps for out in outs) and calls[0] == len(PROMPTS)


def test_bad_batches_are_clear_errors(target):
    config = DecodeConfig(max_new_tokens=4)
    with pytest.raises(SelfdraftError, match="the batch is empty"):
        batched_decode(BatchSession(target), [], NoDrafter(), config)
    with pytest.raises(SelfdraftError, match="prompt 1 of the batch is empty"):
        batched_decode(BatchSession(target), [[1, 2], []], NoDrafter(), config)
    with pytest.raises(SelfdraftError, match="prompt 0 of the batch has 14 tokens but the model's context holds 10"):
        batched_decode(BatchSession(target), PROMPTS[:2], NoDrafter(), config, max_context=10)
    with pytest.raises(SelfdraftError, match="3 seeds for 2 prompts"):
        batched_decode(BatchSession(target), PROMPTS[:2], NoDrafter(), config, seeds=[1, 2, 3])


def test_generate_batch_on_a_real_tokenizer_follows_the_drafters_schedule(tiny_target, tmp_path, caplog):
    """``generate_batch`` (the Python API): one result per prompt, each equal to ``generate``'s; a drafter
    folder's speculation profile gives the drafts per live batch size, one for another target is refused,
    one from another machine is used with a warning; a batch beyond memory is refused before allocating."""
    import json
    import logging

    from selfdraft.heads.target import load_target
    from selfdraft.inference.api import generate, generate_batch
    from selfdraft.heads.cards import PROFILE_FILE

    target = load_target(str(tiny_target))
    prompts = ["def add(a, b):", "The capital of France is", "1, 2, 3, 4,"]
    results = generate_batch(target, prompts, drafter="prompt-lookup", max_new_tokens=12, policy="fixed")
    for prompt, result in zip(prompts, results):
        alone = generate(target, prompt, drafter="prompt-lookup", max_new_tokens=12, policy="fixed")
        assert (result.token_ids, result.text, result.target_forwards) == (alone.token_ids, alone.text, alone.target_forwards)
    # A drafter folder's profile (what generate_batch reads for policy="auto"): 2 drafts at batch 1,
    # none from batch 2 on; batched_decode's use of such a budget is the node-budget test above.
    from selfdraft.inference.cost_report import read_profile
    from selfdraft.inference.policy import schedule_budget

    folder = tmp_path / "drafter"
    folder.mkdir()
    machine = {"cpu": "elsewhere", "gpu": None, "cpus": 1, "threads": 1}
    profile = {"schedule": [{"batch": 1, "tokens": 2}, {"batch": 2, "tokens": 0}],
               "cost_surface": {"target": target.identity.name, "machine": machine}}
    (folder / PROFILE_FILE).write_text(json.dumps(profile))
    with caplog.at_level(logging.WARNING):
        budget = schedule_budget(read_profile(folder), target)
    assert "measured on another machine" in caplog.text
    assert [budget(b) for b in (1, 2, 3, 16)] == [2, 0, 0, 0]
    (folder / PROFILE_FILE).write_text(json.dumps({**profile, "cost_surface": {"target": "another", "machine": machine}}))
    with pytest.raises(SelfdraftError, match="measured with target 'another'"):
        schedule_budget(read_profile(folder), target)
    (folder / PROFILE_FILE).write_text("{not json")
    with pytest.raises(SelfdraftError, match="not a speculation profile selfdraft can read"):
        read_profile(folder)
    with pytest.raises(SelfdraftError, match="prompts is one string"):
        generate_batch(target, "one prompt")
    with pytest.raises(SelfdraftError, match="the largest batch that fits is"):
        generate_batch(target, input_ids=[[1, 2, 3]] * 4, max_new_tokens=2**26)


def test_the_batch_throttle_drafts_only_where_drafting_pays_at_the_live_batch_size(target, drafters):
    """The adaptive policy in a batch, on a made-up cost surface: a draft token costs 1% of a step at batch 1 and a whole step
    at batch 4. The self-drafting target (it accepts nearly everything) drafts every step alone and stops
    in a batch of 4; a random EAGLE-3 (it accepts next to nothing) stops even alone, then only probes,
    ever more rarely. Every row stays greedy-exact."""
    from selfdraft.inference.costs import CostSurface

    surface = CostSurface(batch_sizes=(1, 4), tokens=(1, 2, 16), seconds=((1.0, 1.01, 1.15), (2.0, 4.0, 32.0)),
                          target="tiny", dtype="float32", device="cpu", context=256, machine={})
    n = 48
    config = DecodeConfig(max_new_tokens=n)
    for name, rows, drafts_every_step in (("self-draft", 1, True), ("self-draft", 4, False), ("eagle3", 1, False)):
        drafter = drafters[name]
        throttle = Adaptive(surface, draft_seconds=0.0, cut=False)
        outs = batched_decode(BatchSession(target, hidden_layers=drafter.hidden_layers), PROMPTS[:rows], drafter,
                              config, policy=throttle)
        for prompt, out in zip(PROMPTS, outs):
            assert out.token_ids == reference(target, prompt, n), (name, rows)
            s = out.stats
            assert s.drafted_steps + s.skipped_steps == s.target_forwards - 1
            if drafts_every_step:
                assert s.skipped_steps == 0, (name, rows, s.drafted_steps)
            else:  # drafted its first steps (fewer in a batch: each step teaches it B rows), then plain steps
                first = -(-throttle.min_drafted // rows)  # with a few probes between them
                assert s.skipped_steps > 3 * (s.drafted_steps - first), (name, rows, s.drafted_steps, s.skipped_steps)
        assert throttle.last.samples >= throttle.min_drafted


def test_the_batch_throttle_charges_a_batched_drafter_its_batch_cost():
    """A drafter that drafts row by row costs B proposals per step; a batched one (the block drafters) what
    its batch costs. Same made-up surface and acceptance (4 tokens per row per drafted step, a step of 4
    rows costing 2 s plain and 2.2 s over the widest tree): a proposal of 3 s makes row-by-row drafting a
    loss at B = 4 (2.2 + 4 x 3 s for 4x the tokens of a 2 s step) and a batch proposal of 3 s a gain."""
    from selfdraft.inference.costs import CostSurface

    surface = CostSurface(batch_sizes=(1, 4), tokens=(1, 16), seconds=((1.0, 1.1), (2.0, 2.2)), target="tiny",
                          dtype="float32", device="cpu", context=256, machine={})
    row_by_row, batched = Adaptive(surface, 3.0).run(4), Adaptive(surface, lambda rows: 3.0).run(4)
    rows, tree = range(4), DraftTree.chain(list(range(15)))
    for throttle in (row_by_row, batched):
        for _ in range(8):
            throttle.record(rows, [tree] * 4, [4, 4, 4, 4], [None] * 4)
        assert not throttle.learning()
    assert row_by_row.policy.draft_seconds(4) == 12.0 and not row_by_row.pays(4)
    assert batched.policy.draft_seconds(4) == 3.0 and batched.pays(4)
    # a plain step; the drafter's whole tree
    assert row_by_row.plan(rows, [40] * 4) == 0 and batched.plan(rows, [40] * 4) is None


class RightForSome(Drafter):
    """Drafts the target's own next four tokens for the prompts in ``right``, wrong tokens for the others."""

    name = "right-for-some"
    max_nodes = 4

    def __init__(self, truths: dict[tuple, list[int]], right: set[tuple]):
        self.truths, self.right = truths, right

    def propose(self, state, sequence):
        prompt = next(p for p in self.truths if tuple(sequence[: len(p)]) == p)
        truth, t = list(prompt) + self.truths[prompt], len(sequence)
        tokens = [truth[t + d] if t + d < len(truth) else 0 for d in range(4)]
        return DraftTree.chain(tokens if prompt in self.right else [(x + 1) % 97 for x in tokens]), state


def test_one_row_that_accepts_nothing_keeps_a_fixed_batch_from_drafting(target):
    """A fixed batch lasts as long as its slowest row: on a surface where verifying more tokens per row is
    dear, a batch of a row that accepts everything and one that accepts nothing stops drafting (the mean
    tokens per row would pay; the slow row's 1 does not), while the good row alone drafts every step. Rows
    stay exact."""
    from selfdraft.inference.costs import CostSurface

    surface = CostSurface(batch_sizes=(1, 4), tokens=(1, 5), seconds=((1.0, 1.5), (2.0, 3.0)), target="tiny",
                          dtype="float32", device="cpu", context=256, machine={})
    n = 48
    prompts = [PROMPTS[0], PROMPTS[2]]
    refs = {tuple(p): reference(target, p, n + 8) for p in prompts}
    drafter = RightForSome(refs, {tuple(prompts[0])})
    config = DecodeConfig(max_new_tokens=n)
    alone = batched_decode(BatchSession(target), prompts[:1], drafter, config, policy=Adaptive(surface, 0.0, cut=False))
    assert alone[0].stats.skipped_steps == 0 and alone[0].token_ids == refs[tuple(prompts[0])][:n]
    throttle = Adaptive(surface, 0.0, cut=False)
    outs = batched_decode(BatchSession(target), prompts, drafter, config, policy=throttle)
    for p, out in zip(prompts, outs):
        assert out.token_ids == refs[tuple(p)][:n]
    assert throttle.last.row_tokens[0] >= 1.9 and throttle.last.row_tokens[1] == 1.0  # it learnt on one cheap node a row
    slow = outs[1].stats
    assert slow.skipped_steps > 2 * (slow.drafted_steps - throttle.min_drafted // 2), (slow.drafted_steps, slow.skipped_steps)


def test_the_value_cut_acts_at_every_batch_size_and_rows_stay_exact(target):
    """Copying's trees carry values; the policy's cut (no gate) verifies only the width that pays at the
    live batch size: on a surface where verifying is nearly free alone and dear at 4 rows, a batch of 4
    verifies fewer nodes per drafted row-step than each prompt alone, and every row equals its greedy output."""
    from selfdraft.inference.costs import CostSurface

    surface = CostSurface(batch_sizes=(1, 4), tokens=(1, 2, 9), seconds=((1.0, 1.01, 1.1), (2.0, 2.6, 9.0)),
                          target="tiny", dtype="float32", device="cpu", context=256, machine={})
    n = 48
    prompts = [PROMPTS[0] * 2, PROMPTS[1] * 2, PROMPTS[2] * 2, PROMPTS[0] + PROMPTS[2]]  # repeats, for copying
    config = DecodeConfig(max_new_tokens=n)
    outs = batched_decode(BatchSession(target), prompts, CopyDrafter(), config, policy=Adaptive(surface, 0.0, gate=False))
    alone = [batched_decode(BatchSession(target), [p], CopyDrafter(), config, policy=Adaptive(surface, 0.0, gate=False))[0]
             for p in prompts]
    for p, out, one in zip(prompts, outs, alone):
        assert out.token_ids == one.token_ids == reference(target, p, n)
    per_step = sum(o.stats.draft_nodes for o in outs) / sum(o.stats.drafted_steps for o in outs)
    per_step_alone = sum(o.stats.draft_nodes for o in alone) / sum(o.stats.drafted_steps for o in alone)
    assert sum(o.stats.proposed_nodes for o in outs) > sum(o.stats.draft_nodes for o in outs) > 0
    assert per_step < per_step_alone, (per_step, per_step_alone)
