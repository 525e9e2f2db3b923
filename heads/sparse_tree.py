"""Static draft trees chosen from measured acceptance: Medusa's sparse tree, and the acceptance length
a tree is expected to reach.

A *choice* is a path of ranks: (0, 1) is depth 2's second-best token below depth 1's best token. A
tree is a set of choices closed under prefixes. :func:`sparse_tree` picks, for a node budget, the
choices with the highest expected acceptance given per-depth rank accuracies (measured on held-out
data while training); :func:`expected_acceptance` scores that tree, which is how a training run
predicts the acceptance length of any kind's tree.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

from selfdraft.errors import SelfdraftError

Choice = tuple[int, ...]

# The tree a Medusa drafter decodes with when it stores no measured accuracies: 10 nodes, small enough
# for a CPU, where verifying a few more tokens costs little more than one.
CPU_CHOICES: tuple[Choice, ...] = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0))


def normalise_choices(choices: Sequence[Sequence[int]], num_heads: int | None = None) -> list[Choice]:
    """Validate choices and sort them by (depth, ranks): parents before children.

    Every prefix of a choice must be a choice; ranks are >= 0; depth is at most ``num_heads``.
    """
    normal = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    present = set(normal)
    for c in normal:
        if not c or min(c) < 0:
            raise SelfdraftError(f"tree choice {c} must be a non-empty path of ranks >= 0")
        if len(c) > 1 and c[:-1] not in present:
            raise SelfdraftError(f"tree choice {c} has no parent {c[:-1]} among the choices")
        if num_heads is not None and len(c) > num_heads:
            raise SelfdraftError(f"tree choice {c} is {len(c)} deep but there are only {num_heads} heads")
    return normal


def sparse_tree(accuracy: torch.Tensor, budget: int) -> list[Choice]:
    """The ``budget`` choices with the highest expected acceptance.

    accuracy: (K, R), accuracy[k, r] = probability that head k's rank-r token is the right one
    (measured on held-out data). A choice is accepted with the product of its path's accuracies, so
    the expected acceptance length of a tree is the sum over its choices; a child never beats its
    parent, so best-first expansion from the root is optimal.
    """
    acc = accuracy.double().tolist()
    heads, ranks = len(acc), len(acc[0])
    frontier = [(-acc[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    chosen: list[Choice] = []
    while frontier and len(chosen) < budget:
        neg, choice = heapq.heappop(frontier)
        chosen.append(choice)
        if len(choice) < heads:
            for r in range(ranks):
                heapq.heappush(frontier, (neg * acc[len(choice)][r], choice + (r,)))
    return normalise_choices(chosen, heads)


def expected_acceptance(accuracy: torch.Tensor, budget: int) -> float:
    """The acceptance length (tokens per target forward) that per-depth rank accuracies (K, R) predict
    for the best tree of ``budget`` nodes (:func:`sparse_tree`): 1 + the sum over its nodes of the
    product of their path's accuracies. It treats depths as independent, as the tree choice does; an
    EAGLE-2 dynamic tree of the same depth, top-k and node count is scored by this static one."""
    acc = accuracy.double().tolist()
    total = 1.0
    for choice in sparse_tree(accuracy, budget):
        p = 1.0
        for depth, rank in enumerate(choice):
            p *= acc[depth][rank]
        total += p
    return total
