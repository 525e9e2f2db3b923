"""Decoding with Medusa heads (the inference side of the kind): the tree of ``choices`` filled with the
heads' top-ranked tokens."""

from __future__ import annotations

from typing import Sequence

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.medusa.module import MedusaHeads
from selfdraft.heads.small_batch import use_small_batch_matmul
from selfdraft.heads.sparse_tree import CPU_CHOICES, normalise_choices, sparse_tree
from selfdraft.inference.drafters import Drafter, Verified, on_target
from selfdraft.inference.session import StepOutput
from selfdraft.inference.tree import DraftTree


class MedusaDrafter(Drafter):
    """Proposes the tree of ``choices`` filled with the heads' top-ranked tokens.

    Its state is the target's final hidden state (D,) at the position that produced the root. The heads
    are moved to the target's device and dtype (a line on stderr says so when that converts anything);
    a proposal is one top-k over all heads and one gather on the device, then one copy to the host.
    """

    name = "medusa"

    def __init__(self, heads: MedusaHeads, target_model, choices: Sequence[Sequence[int]] = CPU_CHOICES):
        text = target_model.config.get_text_config()
        if heads.hidden_size != text.hidden_size:
            raise SelfdraftError(f"these Medusa heads read hidden states of size {heads.hidden_size}; the target's are "
                                 f"{text.hidden_size}: they were trained for another target")
        self.heads = on_target(heads, target_model, "the Medusa heads").eval()
        self.small_batch = use_small_batch_matmul(self.heads)  # the K heads' rows (explicit: .remove() undoes it)
        self.lm_head = target_model.get_output_embeddings()
        self.choices = normalise_choices(choices, heads.num_heads)
        self.max_nodes = len(self.choices)
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


def adapter(heads: MedusaHeads, decode: dict, target, tree: dict[str, int]) -> MedusaDrafter:
    """The Medusa drafter of a loaded folder: the tree stored with it (``decode["choices"]``), or with
    ``tree["max_nodes"]`` given, the sparse tree of that many nodes rebuilt from the per-head rank
    accuracies that training measured and stored. Its depth is its head count, its ranks are those
    measured: ``depth`` and ``top_k`` do not apply."""
    unusable = sorted(set(tree) - {"max_nodes"})
    if unusable:
        raise SelfdraftError(f"a Medusa tree is chosen from the heads' measured accuracies: only max_nodes applies, "
                             f"not {', '.join(unusable)}")
    # A folder without a stored tree (an engine layout, which has no place for one): the default tree,
    # cut to the heads there are.
    choices = decode.get("choices") or [c for c in CPU_CHOICES if len(c) <= heads.num_heads]
    if "max_nodes" in tree:
        if "rank_accuracy" not in decode:
            raise SelfdraftError(f"this Medusa drafter stores no measured accuracies to build a {tree['max_nodes']}-node "
                                 "tree from (an imported one): decode it with its stored tree")
        choices = sparse_tree(torch.tensor(decode["rank_accuracy"]), tree["max_nodes"])
    return MedusaDrafter(heads, target.model, choices)
