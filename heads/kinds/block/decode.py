"""Decoding with DFlash and DSpark drafters (the inference side of the block kinds): one drafter forward
per step proposes a block, verified as a chain.

Alignment. With committed tokens x_0..x_{L-1} (x_{L-1}, the anchor, not yet read by the target), the
target has produced hidden states at positions 0..L-2: the drafter's context, kept as each draft layer's
keys and values (fused once per position, appended as verification commits tokens). The block is
[x_{L-1}, mask, ...] at positions L-1, L, ...; its drafted token j is x_{L+j}. DFlash reads all of them
from one forward (argmax per slot); DSpark adds its Markov bias left to right, the previous token
being the anchor, then each drafted token in turn. Drafts are deterministic given the state, so the
decoder's verification keeps the target's output exact, greedy or sampled.

Each drafted token carries a value (the tree's ``values``): the chance that the target accepts the
path to it, the product along the block of DSpark's confidence head (or, without one, of the
drafter's probability of each token it drafted), by which confidence-scheduled verification
(inference/policy.py) verifies only the prefix of the block that pays.

Branching (``top_k`` > 1): where the drafter is unsure, a tree instead of a chain, from the same one
forward. Slot j's distribution is the drafter's for the j-th drafted token; the tree grows as EAGLE-2's
does (:func:`~selfdraft.inference.tree.grow_dynamic_tree`: the ``top_k`` best nodes of a depth expanded
into their ``top_k`` best children, the ``max_nodes`` best by cumulative probability kept), so a second
candidate appears exactly where the first one's probability leaves room for it. DFlash's slots do not
read the tokens before them, so every node of a depth gets that slot's distribution; DSpark's Markov
head biases each node's children by the node's own token. Node values are the cumulative drafter
probabilities (DSpark's confidence head scores its own chain's tokens, not the alternatives).

Batches: :meth:`BlockDrafter.propose_batch` drafts every row of a batch in one forward (contexts padded
to the longest, the padding masked), so a batch of B rows costs far less than B proposals.

Devices: the drafter is a copy on the target's device and dtype; the block's tokens and values reach
the host in one copy per proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfdraft.configs.decode import TreeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.block.module import BlockHead
from selfdraft.inference.drafters import Drafter, Verified, on_target
from selfdraft.inference.session import StepOutput
from selfdraft.inference.tree import DraftTree, grow_dynamic_tree


@dataclass
class BlockState:
    """A sequence's drafter state: each draft layer's context keys and values ((N, heads, d) each) over
    positions 0..N-1, and the target's fused-layer states (m, n H) of positions N..N+m-1 not yet added."""

    context: list[tuple[torch.Tensor, torch.Tensor]]
    length: int
    pending: torch.Tensor


class BlockDrafter(Drafter):
    """A DFlash or DSpark module behind the :class:`Drafter` interface, proposing ``depth`` tokens of
    its block (at most the block's drafts) as a chain, or with ``top_k`` > 1 a tree of ``max_nodes``
    nodes that branches where the drafter is unsure (module docstring)."""

    batched = True

    def __init__(self, drafter: BlockHead, target_model, tree: TreeConfig = TreeConfig()):
        text = target_model.config.get_text_config()
        kind = drafter.dims.KIND_FIELD
        if drafter.hidden_size != text.hidden_size or drafter.vocab_size != text.vocab_size:
            raise SelfdraftError(f"this {kind} drafter is for hidden size {drafter.hidden_size} and vocabulary "
                                 f"{drafter.vocab_size}; the target has {text.hidden_size} and {text.vocab_size}")
        if max(drafter.dims.target_layers) > text.num_hidden_layers:
            raise SelfdraftError(f"this {kind} drafter reads target layers {list(drafter.dims.target_layers)}; the target "
                                 f"has {text.num_hidden_layers}")
        self.drafter = on_target(drafter, target_model, f"the {kind} drafter").eval()
        self.name = kind
        self.config = tree  # the tree it proposes; its cost is keyed by it (inference/costs.py's drafter shape)
        self.drafts = min(tree.depth, drafter.dims.drafts_per_block)
        self.max_nodes = self.drafts if tree.top_k == 1 else tree.max_nodes
        self.embed = target_model.get_input_embeddings()
        self.lm_head = target_model.get_output_embeddings()
        self.hidden_layers = self.drafter.target_layers(text.num_hidden_layers)
        self.device, self.dtype = target_model.device, target_model.dtype
        self.draft_ids = self.drafter.token_map()  # (V',) of the copy on the target's device, or None
        self.first = 1 - self.drafter.draft_offset  # the slot of the first drafted token
        slots = self.drafter.block_size
        self.block_tail = torch.full((slots - 1,), self.drafter.mask_token_id, dtype=torch.long, device=self.device)
        self.slots = torch.arange(slots, device=self.device)

    @torch.inference_mode()
    def start(self, prompt_ids, prefill: StepOutput) -> BlockState:
        shape = (0, self.drafter.dims.num_heads, self.drafter.dims.head_dim)
        empty = [(torch.empty(shape, dtype=self.dtype, device=self.device),) * 2 for _ in self.drafter.layers]
        return BlockState(empty, 0, torch.cat(prefill.hidden, dim=-1))

    @torch.inference_mode()
    def _catch_up(self, state: BlockState) -> BlockState:
        m = state.pending.shape[0]
        if m == 0:
            return state
        positions = torch.arange(state.length, state.length + m, device=self.device)
        new = self.drafter.context_kv(self.drafter.fuse(state.pending.to(self.dtype)), positions)
        context = [(torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(state.context, new)]
        return BlockState(context, state.length + m, state.pending[:0])

    def propose(self, state: BlockState, sequence):
        return self.propose_batch([state], [sequence])[0]

    @torch.inference_mode()
    def propose_batch(self, states, sequences):
        """One drafter forward for every row's block: contexts of different lengths padded to the
        longest, the padding invisible to the block (each row's drafts are what its own forward drafts,
        up to the float rounding of a larger product); the blocks' tokens and values reach the host in
        one copy."""
        states = [self._catch_up(s) for s in states]
        for state, sequence in zip(states, sequences):
            if state.length != len(sequence) - 1:
                raise SelfdraftError(f"block drafter state out of step: context of {state.length} positions for a "
                                     f"sequence of {len(sequence)} tokens; propose() must get the sequence this "
                                     "state observed")
        rows = len(states)
        lengths = torch.tensor([s.length for s in states], device=self.device)
        longest = max(s.length for s in states)
        anchors = torch.tensor([int(q[-1]) for q in sequences], dtype=torch.long, device=self.device)  # (R,)
        ids = torch.cat([anchors[:, None], self.block_tail.expand(rows, -1)], dim=1)  # (R, S)
        positions = (lengths[:, None] + self.slots)[:, None]  # (R, 1, S)
        if rows == 1:
            context, visible = [(k[None], v[None]) for k, v in states[0].context], None
        else:
            def padded(t: torch.Tensor) -> torch.Tensor:  # (n, heads, d) -> (longest, heads, d), zeros after n
                return torch.nn.functional.pad(t, (0, 0, 0, 0, 0, longest - t.shape[0]))

            context = [(torch.stack([padded(s.context[i][0]) for s in states]),
                        torch.stack([padded(s.context[i][1]) for s in states])) for i in range(len(self.drafter.layers))]
            visible = (torch.arange(longest, device=self.device)[None] < lengths[:, None])[:, None]  # (R, 1, N)
        out = self.drafter(self.embed(ids)[:, None], positions, context, visible)
        out = out[:, 0, self.first:self.first + self.drafts]  # (R, K, H): the drafted slots
        if self.config.top_k > 1:
            logits = self._logits(out)
            return [(self._tree(logits[r], anchors[r]), state) for r, state in enumerate(states)]
        tokens, accept = self._draft(out, anchors)  # (R, K) each
        values = accept.float().cumprod(-1)  # the chance that the path to each drafted token is accepted
        host = torch.stack([tokens.to(values.dtype), values]).cpu()  # one copy to the host per proposal
        return [(DraftTree.chain(host[0, r].long().tolist(), host[1, r].clamp(0, 1).tolist()), state)
                for r, state in enumerate(states)]

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """(..., H) slot outputs -> (..., V') float logits over the draft vocabulary."""
        return self.drafter.head(self.lm_head)(out)[..., : self.drafter.draft_vocab_size].float()

    def _tree(self, logits: torch.Tensor, anchor: torch.Tensor) -> DraftTree:
        """One row's tree from its slots' logits (K, V') and its anchor (a 0-d target id)."""
        markov = self.drafter.markov_head is not None
        slot = iter(range(1, logits.shape[0]))  # grow_dynamic_tree expands one depth per call, in order

        def expand(tokens, rows, positions, visible):  # tokens: (m,) target ids of the nodes expanded
            j = next(slot)
            if markov:
                return (logits[j] + self.drafter.markov_bias(tokens).float()).log_softmax(-1)
            return logits[j].log_softmax(-1).expand(tokens.shape[0], -1)

        first = logits[0] + self.drafter.markov_bias(anchor[None])[0].float() if markov else logits[0]
        return grow_dynamic_tree(first.log_softmax(-1), expand, depth=logits.shape[0], top_k=self.config.top_k,
                                 max_nodes=self.max_nodes, past=0, to_target=self._to_target)

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids."""
        return ids if self.draft_ids is None else self.draft_ids[ids]

    def _draft(self, out: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, K, H) slot outputs of R blocks with anchors (R,) -> ((R, K) target ids, (R, K) each token's
        estimated acceptance chance given the ones before it). Each slot's argmax (DSpark: with the
        Markov bias of the token before it, left to right). The chance: DSpark's confidence head where it
        has one, else the drafter's own probability of the token it drafted."""
        logits = self._logits(out)  # (R, K, V')
        if self.drafter.markov_head is None:
            probs, ids = logits.softmax(-1).max(-1)
            return self._to_target(ids), probs
        previous = anchors  # (R,): stays on the device
        before, drafted, probs = [], [], []
        for j in range(logits.shape[1]):
            before.append(previous)
            p, pick = (logits[:, j] + self.drafter.markov_bias(previous).float()).softmax(-1).max(-1)
            previous = self._to_target(pick)
            drafted.append(previous)
            probs.append(p)
        ids = torch.stack(drafted, dim=1)
        if self.drafter.confidence_head is None:
            return ids, torch.stack(probs, dim=1)
        return ids, torch.sigmoid(self.drafter.confidence(out, torch.stack(before, dim=1)))

    def observe(self, state: BlockState, verified: Verified) -> BlockState:
        with torch.inference_mode():
            pending = torch.cat([state.pending, torch.cat(verified.hidden, dim=-1)])
        return BlockState(state.context, state.length, pending)


def adapter(drafter: BlockHead, decode: dict, target, tree: dict[str, int]) -> BlockDrafter:
    """The drafter of a loaded folder, proposing the chain stored with it (``decode["tree"]``) with the
    fields of ``tree`` replaced; ``top_k`` > 1 branches (a tree of ``max_nodes`` nodes, by default
    twice the chain's)."""
    stored = {**decode.get("tree", {}), **tree}
    depth = stored.get("depth", drafter.dims.drafts_per_block)
    top_k = stored.get("top_k", 1)
    max_nodes = stored.get("max_nodes", 2 * depth if top_k > 1 else depth)
    return BlockDrafter(drafter, target.model, TreeConfig(depth=depth, top_k=top_k, max_nodes=max_nodes))
