"""The drafting policy's value cut (inference/policy.py): at one row the best node set for the cost curve,
at B rows the best common width for the batch's costs. A cut block drafter decodes exactly: greedy in
tests/test_block_drafters.py, sampled in tests/test_sampling_exact.py; batched rows under the cut in
tests/test_batch.py. The adaptive policy's decisions are in tests/test_adaptive.py."""

from __future__ import annotations

import random

import pytest

from selfdraft.errors import SelfdraftError
from selfdraft.inference.costs import CostSurface
from selfdraft.inference.policy import policy_for, value_cut
from selfdraft.inference.tree import DraftTree, DraftTreeError


def linear_cost(base: float, per_token: float, n: int = 24) -> CostSurface:
    return CostSurface.row(tuple(base + per_token * m for m in range(1, n + 1)), target="t", dtype="float32", device="cpu", context=256)


def closed_subsets(parents):
    """Every node set that holds each member's parent (the trees a cut may verify)."""
    n = len(parents)
    for mask in range(1 << n):
        keep = [i for i in range(n) if mask >> i & 1]
        if all(parents[i] < 0 or mask >> parents[i] & 1 for i in keep):
            yield keep


def test_the_cut_is_the_best_tree_for_the_cost_curve():
    """Against every closed node set of random trees (values made non-increasing along paths, as the
    cut makes them): the cut's expected tokens per second is the best."""
    rng = random.Random(0)
    for trial in range(60):
        n = rng.randint(1, 9)
        parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
        values = []
        for i, p in enumerate(parents):
            values.append(rng.random() * (1.0 if p < 0 else values[p]))
        cost = linear_cost(rng.uniform(0.01, 0.05), rng.uniform(0.0, 0.02))
        draft_seconds = rng.uniform(0.0, 0.01)
        tree = DraftTree.from_lists(range(100, 100 + n), parents, values)
        [cut] = value_cut([tree], cost, draft_seconds)

        def rate(keep):
            return (1 + sum(values[i] for i in keep)) / (cost(1, len(keep) + 1) + draft_seconds)

        best = max(rate(k) for k in closed_subsets(parents))
        kept = [tree.token_ids.index(t) for t in cut.token_ids]
        assert rate(kept) == pytest.approx(best, rel=1e-9), (trial, parents, values, kept)
        assert cut.values == tuple(tree.values[i] for i in kept)  # the kept nodes keep their values


def test_a_chain_is_cut_where_the_next_token_no_longer_pays():
    cost = linear_cost(0.020, 0.004)

    def cut(tree, surface=cost):
        return value_cut([tree], surface, 0.0)[0]

    chain = DraftTree.chain([5, 6, 7, 8, 9], [0.9, 0.8, 0.5, 0.3, 0.1])
    assert cut(chain).token_ids == (5, 6, 7)  # 3.2 tokens / 36 ms beats 2.7 / 32 and 3.5 / 40
    assert cut(DraftTree.chain([5, 6], [0.05, 0.01])).num_nodes == 0  # a plain step pays more
    assert cut(chain, linear_cost(0.020, 0.0)).num_nodes == 5  # verification costs nothing more: keep everything
    unvalued = DraftTree.chain([5, 6, 7])
    assert cut(unvalued) is unvalued
    # A drafter that claims more for a child than for its parent is read as the parent's value.
    assert cut(DraftTree.chain([5, 6], [0.1, 0.99])).num_nodes == 0


def test_at_several_rows_the_cut_is_the_best_common_width_for_the_batch_cost():
    """A step of B rows costs T(B, w + 1) for the widest row's w nodes: against every width, the cut's
    expected tokens per second over the batch is the best, each row keeping its best min(w, its nodes),
    and the width follows the batch size's own costs (verifying is dear at B = 4, nearly free at B = 1)."""
    rng = random.Random(1)
    for trial in range(40):
        rows = rng.randint(2, 5)
        trees, ranked = [], []
        for _ in range(rows):
            n = rng.randint(0, 7)
            values = sorted((rng.random() for _ in range(n)), reverse=True)
            trees.append(DraftTree.chain(list(range(100, 100 + n)), values))
            ranked.append(values)
        base, per_token = rng.uniform(0.01, 0.05), rng.uniform(0.0, 0.02)
        cost = CostSurface((1, 8), tuple(range(1, 10)), (tuple(base + per_token * m for m in range(9)),
                                                           tuple(2 * base + 4 * per_token * m for m in range(9))),
                           target="t", dtype="float32", device="cpu", context=256, machine={})
        d = rng.uniform(0.0, 0.01)
        cut = value_cut(trees, cost, d)

        def rate(w):
            return (1 + sum(sum(v[:w]) for v in ranked) / rows) * cost(rows, 1) / (cost(rows, w + 1) + d) if w else \
                cost(rows, 1) / (cost(rows, 1) + d)

        widest = max(t.num_nodes for t in trees)
        best = max(rate(w) for w in range(widest + 1))
        w = max(t.num_nodes for t in cut)
        assert rate(w) == pytest.approx(best, rel=1e-9), (trial, ranked, w)
        for tree, kept in zip(trees, cut):
            assert kept.token_ids == tree.token_ids[:min(w, tree.num_nodes)]
    cost = CostSurface((1, 4), (1, 2, 3), ((1.0, 1.0, 1.0), (1.0, 2.0, 3.0)), target="t", dtype="float32",
                       device="cpu", context=256, machine={})
    pair = [DraftTree.chain([5, 6], [0.6, 0.3]), DraftTree.chain([7, 8], [0.5, 0.2])]
    assert value_cut(pair[:1], cost, 0.0)[0].num_nodes == 2  # one row: verifying is free at batch 1 here
    assert [t.num_nodes for t in value_cut(pair, cost, 0.0)] == [1, 1]  # two: a second token a row no longer pays
    assert [t.num_nodes for t in value_cut(pair * 2, cost, 0.0)] == [0, 0, 0, 0]  # four: a token costs a step


def test_bad_values_and_bad_schedules_are_refused():
    with pytest.raises(DraftTreeError, match="one probability in"):
        DraftTree.chain([1, 2], [0.5])
    with pytest.raises(DraftTreeError, match="one probability in"):
        DraftTree.chain([1, 2], [0.5, 1.5])
    with pytest.raises(SelfdraftError, match="unknown drafting policy 'sometimes'.*adaptive, cut, fixed, profile"):
        policy_for(None, None, "sometimes")




def test_the_previous_releases_options_say_which_policy_they_mean(caplog):
    """--adaptive, --schedule and --speculation stay one release as aliases: each maps to the policy it
    meant and says so; a bad value of one names the allowed values and the policies. An unknown
    --policy is refused by the CLI with the policies that exist, before anything loads."""
    import logging
    import subprocess
    import sys

    from selfdraft.configs.decode import legacy_policy

    assert legacy_policy() is None
    with caplog.at_level(logging.WARNING):
        assert legacy_policy(adaptive="off") == "cut"
    assert "policy='cut' (--policy cut)" in caplog.text
    assert legacy_policy(adaptive="off", schedule="off") == "fixed"
    assert legacy_policy(speculation="off") == "fixed"
    assert legacy_policy(adaptive="on") == legacy_policy(schedule="confidence") == legacy_policy(speculation="auto") == "auto"
    with pytest.raises(SelfdraftError, match="unknown adaptive 'maybe'; choose one of on, off.*auto, adaptive, cut"):
        legacy_policy(adaptive="maybe")
    proc = subprocess.run([sys.executable, "-m", "selfdraft", "generate", "--prompt", "hi", "--policy", "sometimes"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'sometimes'" in proc.stderr
    assert "'auto', 'adaptive', 'cut', 'fixed', 'profile'" in proc.stderr, proc.stderr
