"""Copy drafting and hybrid drafting (inference/hybrid.py): the suffix match and its valued tree, the merge
of a copy tree with a drafter's tree, each source's calibration, and the drafter skipped where copying
makes it not worth its cost. Greedy exactness with every drafter kind is in test_adaptive.py (beside
the throttle's), sampled losslessness in test_sampling_exact.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from selfdraft.configs.decode import CopyConfig, HybridConfig
from selfdraft.errors import SelfdraftError
from selfdraft.inference.drafters import Drafter, Verified
from selfdraft.inference.hybrid import CopyDrafter, HybridDrafter, longest_suffix_match, valued_tree
from selfdraft.inference.costs import CostSurface
from selfdraft.inference.tree import DraftTree


def test_longest_suffix_match():
    seq = np.array([7, 1, 2, 3, 9, 1, 2, 3, 4, 2, 3])
    n, ends = longest_suffix_match(seq, 32)
    assert n == 2 and ends.tolist() == [3, 7]  # "2 3" occurred twice before; "1 2 3" ends differently here
    n, ends = longest_suffix_match(np.array([1, 2, 3, 1, 2, 3]), 32)
    assert n == 3 and ends.tolist() == [2]
    n, ends = longest_suffix_match(np.array([1, 2, 3, 1, 2, 3]), 2)  # capped
    assert n == 2 and ends.tolist() == [2]
    assert longest_suffix_match(np.array([1, 2, 3]), 32)[0] == 0  # the last token is new
    assert longest_suffix_match(np.array([4]), 32)[0] == 0
    n, ends = longest_suffix_match(np.array([5, 5, 5, 5]), 32)  # overlapping occurrences
    assert n == 3 and ends.tolist() == [2]


def test_copy_tree_counts_the_continuations_of_the_match():
    # "a b c" occurred twice before the end, followed by "d x" and by "d y": d below the root, x and y below d.
    a, b, c, d, x, y = 10, 11, 12, 13, 14, 15
    seq = [a, b, c, d, x, 1, a, b, c, d, y, 2, a, b, c]
    tree, _ = CopyDrafter(CopyConfig(depth=2)).propose(None, seq)
    assert tree.token_ids == (d, x, y) and tree.parent_ids == (-1, 0, 0)
    s = 1 / 3  # smoothing: one over the matched length
    assert tree.values == pytest.approx((2 / (2 + s), 2 / (2 + s) * 1 / (2 + s), 2 / (2 + s) * 1 / (2 + s)))
    # min_value drops the unlikely, max_nodes keeps the most likely
    assert CopyDrafter(CopyConfig(depth=2, min_value=0.5)).propose(None, seq)[0].token_ids == (d,)
    assert CopyDrafter(CopyConfig(depth=4, max_nodes=2)).propose(None, seq)[0].num_nodes == 2
    # a one-token match continued once is worth a half; no match, no tree
    assert CopyDrafter(CopyConfig(depth=1)).propose(None, [3, 4, 3])[0].values == pytest.approx((0.5,))
    assert CopyDrafter().propose(None, [1, 2, 3])[0].num_nodes == 0


def test_valued_tree_keeps_the_best_nodes_closed_under_ancestors():
    tokens, parents, values = [1, 2, 3, 4, 5], [-1, 0, 1, -1, 3], [0.9, 0.5, 0.5, 0.6, 0.1]
    tree = valued_tree(tokens, parents, values, max_nodes=3)
    assert tree.token_ids == (1, 4, 2) and tree.parent_ids == (-1, -1, 0)  # 0.9, 0.6, 0.5 (the earlier of the ties)
    assert tree.values == (0.9, 0.6, 0.5)
    assert valued_tree(tokens, parents, values, max_nodes=9, min_value=0.95).num_nodes == 0


def test_bad_copy_and_hybrid_settings_are_refused():
    for bad in ({"depth": 0}, {"max_nodes": 0}, {"max_pattern": 0}, {"min_value": 1.0}):
        with pytest.raises(SelfdraftError):
            CopyConfig(**bad)
    for bad in ({"max_nodes": 0}, {"prior": 0.0}, {"memory": 1.0}):
        with pytest.raises(SelfdraftError):
            HybridConfig(**bad)


class Scripted(Drafter):
    """Proposes ``tree`` every step and counts its proposals."""

    name = "scripted"

    def __init__(self, tree: DraftTree):
        self.tree, self.max_nodes, self.calls = tree, tree.num_nodes, 0

    def propose(self, state, sequence):
        self.calls += 1
        return self.tree, state


def test_the_merged_tree_is_one_trie_valued_by_the_better_source():
    seq = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]  # copying proposes 4 and 5 below the root, each 1 / (2 + 1/3)
    model = Scripted(DraftTree.from_lists([4, 6, 7], [-1, 0, -1], [0.9, 0.8, 0.05]))
    hybrid = HybridDrafter(model, CopyDrafter(CopyConfig(depth=1)), HybridConfig(max_nodes=3))
    state = hybrid.start(seq, None)
    tree, state = hybrid.propose(state, seq)
    # 4 is proposed by both (one node, the model's 0.9), then 6 below it (0.8), then copying's 5 (0.43); 7 is cut
    assert tree.token_ids == (4, 5, 6) and tree.parent_ids == (-1, -1, 0)
    assert tree.values == pytest.approx((0.9, 1 / (2 + 1 / 3), 0.8))
    # The target accepts 4 and 6: both sources get 4, only the model 6.
    state = hybrid.observe(state, Verified([4, 6, 9]))
    copy_cal, model_cal = state.calibration
    m, prior = hybrid.config.memory, hybrid.config.prior
    assert copy_cal.accepted == pytest.approx(m * prior + 1) and copy_cal.predicted == pytest.approx(m * prior + 2 * 3 / 7)
    assert model_cal.accepted == pytest.approx(m * prior + 2) and model_cal.predicted == pytest.approx(m * prior + 1.7)
    assert state.runs == 1 and state.gain == 1  # what the drafter added: 6 (copying proposed 4 too)


def test_calibration_follows_what_the_target_accepts_and_the_drafter_is_skipped_when_copying_suffices():
    """A drafter whose nodes the target always rejects loses its weight; with a cost, it stops running
    while copying is sure, and runs again on the policy's back-off probes: after 4 steps, then after
    twice as many each time it stays far from paying."""
    seq = [1, 2, 3, 4] * 6 + [1, 2, 3]  # copying is sure of 4
    model = Scripted(DraftTree.chain([8, 9], [0.9, 0.8]))
    cost = CostSurface.row(tuple(1.0 + 0.01 * m for m in range(64)), target="toy", dtype="float32", device="cpu", context=256)
    hybrid = HybridDrafter(model, CopyDrafter(CopyConfig(depth=1)), HybridConfig(), cost=cost, model_seconds=0.2)
    state = hybrid.start(seq, None)
    ran = []
    for _ in range(40):
        calls = model.calls
        tree, state = hybrid.propose(state, seq)
        ran.append(model.calls > calls)
        state = hybrid.observe(state, Verified([4, 5]))  # the copy's 4 is accepted, never the model's 8
    copy_cal, model_cal = state.calibration
    assert copy_cal.ratio > 1.0 > 0.5 > model_cal.ratio
    assert [i for i, r in enumerate(ran) if r] == [0, 5, 14, 31], ran
    assert state.model_steps == ran.count(True) and state.steps == 40
    assert tree.token_ids == (4,)  # the last step did not run the drafter: the copy's tree alone
