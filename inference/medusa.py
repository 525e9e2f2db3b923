"""Decoding with Medusa heads: static trees from choice lists, and sparse trees from measured accuracy.

A *choice* is a path of ranks: (0, 1) is head 1's second-best token below head 0's best token. A
tree is a set of choices closed under prefixes. :func:`sparse_tree` picks, for a node budget, the
choices with the highest expected acceptance given per-head top-k accuracies (Medusa's sparse tree).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.medusa import MedusaHeads
from selfdraft.heads.small_batch import use_small_batch_matmul
from selfdraft.inference.drafters import Drafter, Verified, on_target
from selfdraft.inference.session import StepOutput
from selfdraft.inference.tree import DraftTree

Choice = tuple[int, ...]

# A small tree for CPUs, where 8-16 verified tokens cost little more than one (FACTS.md): 10 nodes.
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


class MedusaDrafter(Drafter):
    """Proposes the tree of ``choices`` filled with the heads' top-ranked tokens.

    Its state is the target's final hidden state (D,) at the position that produced the root. The heads
    are moved to the target's device and dtype (a line on stderr says so when that converts anything);
    a proposal is one top-k over all heads and one gather on the device, then one copy to the host.
    """

    name = "medusa"

    def __init__(self, heads: MedusaHeads, target_model, choices: Sequence[Sequence[int]] = CPU_CHOICES):
        self.heads = on_target(heads, target_model, "the Medusa heads").eval()
        use_small_batch_matmul(self.heads)  # the K heads' rows
        self.lm_head = target_model.get_output_embeddings()
        self.choices = normalise_choices(choices, heads.num_heads)
        self.hidden_layers = (target_model.config.get_text_config().num_hidden_layers,)  # final normed state
        self.vocab_size = target_model.config.get_text_config().vocab_size
        # Node i's parent index; the head (depth - 1) and rank that fill it, on the device.
        index = {c: i for i, c in enumerate(self.choices)}
        self.parents = tuple(index[c[:-1]] if len(c) > 1 else -1 for c in self.choices)
        self.head_rank = torch.tensor([[len(c) - 1 for c in self.choices], [c[-1] for c in self.choices]],
                                      dtype=torch.long, device=target_model.device)  # (2, N)
        self.ranks = 1 + max(c[-1] for c in self.choices)

    def start(self, prompt_ids, prefill: StepOutput):
        return prefill.hidden[0][-1]

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, sequence):
        if self.heads.lm_heads is None:  # one (K, D) x (D, V) product reads the shared LM head once
            features = torch.stack([blocks(hidden) for blocks in self.heads.blocks])  # (K, D)
            logits = self.lm_head(features)[:, : self.vocab_size]  # (K, V)
        else:
            logits = self.heads(hidden[None], self.lm_head)[:, 0, : self.vocab_size]  # (K, V)
        top = torch.topk(logits, self.ranks, dim=-1).indices  # (K, R)
        tokens = top[self.head_rank[0], self.head_rank[1]]  # (N,)
        return DraftTree.from_lists(tokens.tolist(), self.parents), hidden

    def observe(self, hidden, verified: Verified):
        return verified.hidden[0][-1]


def drafter_from_folder(folder, target, tree_nodes: int | None = None) -> MedusaDrafter:
    """A Medusa drafter from an exported folder, refused unless it was trained for ``target``.

    It decodes with the tree stored in the folder, or with ``tree_nodes`` set, a sparse tree of that
    many nodes rebuilt from the per-head rank accuracies that training measured and stored."""
    from selfdraft.heads.io import load_drafter

    heads, record = load_drafter(folder, target.identity)
    if record.kind != "medusa":
        raise SelfdraftError(f"{folder} holds a {record.kind} drafter, not a medusa one")
    choices = record.decode.get("choices", CPU_CHOICES)
    if tree_nodes is not None:
        if "rank_accuracy" not in record.decode:
            raise SelfdraftError(f"{folder} stores no measured accuracies to build a {tree_nodes}-node tree from")
        choices = sparse_tree(torch.tensor(record.decode["rank_accuracy"]), tree_nodes)
    return MedusaDrafter(heads, target.model, choices)
