"""Confidence-scheduled verification (inference/schedule.py): the cut is the best node set for the cost
curve, the curve is measured once per machine and target and cached. A scheduled block drafter decodes
exactly: greedy in tests/test_block_drafters.py, sampled in tests/test_sampling_exact.py."""

from __future__ import annotations

import json
import random

import pytest
import torch

from selfdraft.errors import SelfdraftError
from selfdraft.inference.costs import CostSurface
from selfdraft.inference.schedule import VerifySchedule, schedule_for
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
        schedule = VerifySchedule(cost, draft_seconds=rng.uniform(0.0, 0.01))
        tree = DraftTree.from_lists(range(100, 100 + n), parents, values)
        cut = schedule.cut(tree)

        def rate(keep):
            return (1 + sum(values[i] for i in keep)) / (cost(1, len(keep) + 1) + schedule.draft_seconds)

        best = max(rate(k) for k in closed_subsets(parents))
        kept = [tree.token_ids.index(t) for t in cut.token_ids]
        assert rate(kept) == pytest.approx(best, rel=1e-9), (trial, parents, values, kept)
        assert cut.values == tuple(tree.values[i] for i in kept)  # the kept nodes keep their values


def test_a_chain_is_cut_where_the_next_token_no_longer_pays():
    schedule = VerifySchedule(linear_cost(0.020, 0.004))
    chain = DraftTree.chain([5, 6, 7, 8, 9], [0.9, 0.8, 0.5, 0.3, 0.1])
    assert schedule.cut(chain).token_ids == (5, 6, 7)  # 3.2 tokens / 36 ms beats 2.7 / 32 and 3.5 / 40
    assert schedule.cut(DraftTree.chain([5, 6], [0.05, 0.01])).num_nodes == 0  # a plain step pays more
    flat = VerifySchedule(linear_cost(0.020, 0.0))
    assert flat.cut(chain).num_nodes == 5  # verification costs nothing more: keep everything
    unvalued = DraftTree.chain([5, 6, 7])
    assert schedule.cut(unvalued) is unvalued
    # A drafter that claims more for a child than for its parent is read as the parent's value.
    assert schedule.cut(DraftTree.chain([5, 6], [0.1, 0.99])).num_nodes == 0


def test_bad_values_and_bad_schedules_are_refused():
    with pytest.raises(DraftTreeError, match="one probability in"):
        DraftTree.chain([1, 2], [0.5])
    with pytest.raises(DraftTreeError, match="one probability in"):
        DraftTree.chain([1, 2], [0.5, 1.5])
    with pytest.raises(SelfdraftError, match="unknown schedule 'sometimes'"):
        schedule_for(None, None, "sometimes")


