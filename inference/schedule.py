"""Confidence-scheduled verification: verify the part of a draft tree that buys the most tokens per
second, with the target's verify cost measured on this machine.

A drafter may give each node of its tree a *value*: its estimate of the probability that the target
accepts the path to that node (DSpark: the product of its confidence head's outputs along the path;
DFlash: the product of its own probabilities of the tokens it drafted). A step that verifies the
node set S emits 1 + sum of the values in S tokens on average (the target's own token always comes)
and costs T(1, |S| + 1) + D: one target forward over the root and S, read off the costs measured
here (inference/costs.py), plus the drafting time D. :meth:`VerifySchedule.cut` keeps the M nodes of
highest value (values never grow along a path, so the M best are a tree: a parent ranks before its
child) for the M with the highest ratio; M = 0 is a plain step.

Exactness: the kept nodes depend only on the drafter's state, never on the target's answer to this
step, so verification keeps greedy output token-identical and sampled output lossless, as for any
tree the drafter could have proposed itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfdraft.errors import SelfdraftError
from selfdraft.inference.costs import COST_TOKENS, CostSurface, draft_cost, speedup, verify_cost
from selfdraft.inference.tree import DraftTree


@dataclass(frozen=True)
class VerifySchedule:
    """Cuts each valued draft tree to the node set with the most expected tokens per second.

    ``draft_seconds``: the drafter's cost per step (:func:`draft_cost`, cached: a cut that read each
    step's own clock would make seeded sampling irreproducible)."""

    cost: CostSurface
    draft_seconds: float = 0.0

    def best_size(self, values: list[float]) -> tuple[int, list[int]]:
        """(M, the M kept node indices in tree order) for node ``values`` already made non-increasing
        along paths; ties keep the smaller M."""
        order = sorted(range(len(values)), key=lambda i: (-values[i], i))
        plain = self.cost(1, 1)
        best_m, best_rate, gain = 0, speedup(1.0, plain + self.draft_seconds, plain), 1.0
        for m, i in enumerate(order, start=1):
            gain += values[i]
            rate = speedup(gain, self.cost(1, m + 1) + self.draft_seconds, plain)
            if rate > best_rate * (1 + 1e-9):
                best_m, best_rate = m, rate
        return best_m, sorted(order[:best_m])

    def cut(self, tree: DraftTree) -> DraftTree:
        """``tree`` cut to its best node set; a tree without values is returned whole."""
        if tree.values is None or tree.num_nodes == 0:
            return tree
        parents = tree.parent_ids
        values = list(tree.values)
        for i, p in enumerate(parents):  # a path is accepted no more often than its prefix
            if p >= 0:
                values[i] = min(values[i], values[p])
        m, keep = self.best_size(values)
        if m == tree.num_nodes:
            return tree
        return tree.subtree(keep)


SCHEDULES = ("confidence", "off")


def schedule_for(target, drafter, mode: str = "confidence") -> VerifySchedule | None:
    """The schedule a decode with ``drafter`` uses: ``confidence`` (the default) where its trees carry
    node values (a block drafter's), with this machine's cost curve for its largest tree; None for
    ``off`` or a drafter whose trees carry none."""
    if mode not in SCHEDULES:
        raise SelfdraftError(f"unknown schedule {mode!r}; choose one of {', '.join(SCHEDULES)}")
    if mode == "off" or not drafter.valued_nodes:
        return None
    return VerifySchedule(verify_cost(target, max(COST_TOKENS, drafter.valued_nodes + 1)), draft_cost(target, drafter))
