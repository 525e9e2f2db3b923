"""Decoding with EAGLE-1 and EAGLE-3 drafters (the inference side of both kinds): EAGLE-2 dynamic trees
over the drafter's own small cache. The two kinds differ only in their modules (which target layers
they read, how they fuse them, which vocabulary they draft over), which this adapter asks.

Alignment. With committed tokens x_0..x_{N-1} (x_{N-1} is the root, not yet seen by the target), the
target has produced features f_0..f_{N-2}. The drafter's position t holds the pair (f_t, x_{t+1}), so
its cache covers positions 0..N-2 and its output there predicts f_{N-1}, whose logits give the
candidates for x_N (tree depth 1). A depth-d node is fed at position N-2+d with its parent's
predicted feature. After verification, the target's features at the root and the accepted nodes are
paired with the tokens that follow them (accepted tokens, then the bonus) on the next proposal.

Dynamic tree (EAGLE-2): depth 1 takes the top-k tokens of the root's prediction; at each further
depth the k nodes with the best cumulative draft log-probability are fed together (one drafter
forward, tree attention over the cache) and each proposes its top-k children; finally the
``max_nodes`` best nodes overall form the tree (a child never scores above its parent, so the set is
closed under ancestors). Tree nodes are cropped from the drafter cache after each proposal.

Devices: the drafter is moved to the target's device and dtype (a line on stderr says so when that
converts anything); the tree grows there (:func:`~selfdraft.inference.tree.grow_dynamic_tree`, masks and
indices made on the device) and reaches the host in one copy per proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from selfdraft.configs.decode import TreeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.eagle.eagle1 import Eagle1Head
from selfdraft.heads.kinds.eagle.eagle3 import Eagle3Head
from selfdraft.heads.small_batch import use_small_batch_matmul
from selfdraft.inference.drafters import Drafter, Verified, on_target
from selfdraft.inference.session import StepOutput
from selfdraft.inference.tree import additive_mask, grow_dynamic_tree


@dataclass
class EagleState:
    """The drafter's per-sequence state, passed in and out of the Drafter methods.

    cache: the drafter's KV cache over its committed positions 0..length-1.
    pending: target features (m, H) for positions length..length+m-1 whose next tokens were not fed yet.
    out: the drafter's output feature (H,) at position length-1 (the prediction for the root), or None.
    """

    cache: DynamicCache
    length: int
    pending: torch.Tensor
    out: torch.Tensor | None


class EagleTreeDrafter(Drafter):
    """An EAGLE-1 or EAGLE-3 drafter module behind the :class:`Drafter` interface, growing an EAGLE-2
    dynamic tree of ``tree`` (depth, top-k, node budget)."""

    def __init__(self, drafter: Eagle1Head | Eagle3Head, target_model, tree: TreeConfig = TreeConfig()):
        self.config = tree
        self.max_nodes = tree.max_nodes
        text = target_model.config.get_text_config()
        kind = drafter.dims.KIND_FIELD
        if drafter.hidden_size != text.hidden_size or drafter.vocab_size != text.vocab_size:
            raise SelfdraftError(f"this {kind} drafter is for hidden size {drafter.hidden_size} and vocabulary "
                                 f"{drafter.vocab_size}; the target has {text.hidden_size} and {text.vocab_size}")
        self.drafter = on_target(drafter, target_model, f"the {kind} drafter").eval()
        self.small_batch = use_small_batch_matmul(self.drafter)  # top_k rows per draft step (explicit: .remove() undoes it)
        self.embed = target_model.get_input_embeddings()
        self.lm_head = target_model.get_output_embeddings()
        self.name = kind
        self.hidden_layers = drafter.target_layers(text.num_hidden_layers)
        self.device, self.dtype = target_model.device, target_model.dtype
        self.draft_ids = self.drafter.token_map()  # (V',) of the copy on the target's device, or None (its vocabulary)

    def _features(self, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Target hidden states (one (m, H) per requested layer) -> drafter input features (m, H)."""
        return self.drafter.features(hidden)

    def _run(self, state: EagleState, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """Feed m (feature, token) pairs (feature (m, H), tokens (m,), positions (m,), mask (1, 1, m, S), all on
        the device); returns the drafter outputs (m, H)."""
        out = self.drafter(feature[None], self.embed(tokens[None]), positions[None], mask, cache=state.cache)
        return out[0]

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """(m, H) outputs -> (m, V or V') draft log-probabilities."""
        return torch.log_softmax(self.drafter.logits(out, self.lm_head).float(), dim=-1)

    def _token_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (EAGLE-3); identity for EAGLE-1."""
        return ids if self.draft_ids is None else self.draft_ids[ids]

    @torch.inference_mode()
    def start(self, prompt_ids, prefill: StepOutput) -> EagleState:
        return EagleState(cache=DynamicCache(config=self.drafter.layer_config), length=0,
                          pending=self._features(prefill.hidden), out=None)

    @torch.inference_mode()
    def _catch_up(self, state: EagleState, sequence) -> EagleState:
        """Feed the pending target features with the tokens that followed them (causal)."""
        m = state.pending.shape[0]
        if m == 0:
            return state
        tokens = torch.tensor(list(sequence[state.length + 1:state.length + 1 + m]), dtype=torch.long, device=self.device)
        if tokens.numel() != m:
            raise SelfdraftError(f"EAGLE state out of step: {m} pending target features but {tokens.numel()} tokens "
                                 "after them; propose() must get the sequence this state observed (start/observe)")
        positions = torch.arange(state.length, state.length + m, device=self.device)
        mask = None
        if state.length and m > 1:  # causal over the new block, everything cached is visible
            visible = torch.ones(m, state.length + m, dtype=torch.bool, device=self.device).tril(diagonal=state.length)
            mask = additive_mask(visible, self.dtype)
        out = self._run(state, state.pending, tokens, positions, mask)
        return EagleState(state.cache, state.length + m, state.pending[:0], out[-1])

    @torch.inference_mode()
    def propose(self, state: EagleState, sequence):
        state = self._catch_up(state, sequence)
        base = state.length
        last = state.out[None]  # (rows, H): the outputs whose predictions the next expanded nodes are

        def expand(tokens, rows, positions, visible):
            nonlocal last
            last = self._run(state, last[rows], tokens, positions, additive_mask(visible, self.dtype))  # (m, H)
            return self._log_probs(last)

        cfg = self.config
        tree = grow_dynamic_tree(self._log_probs(state.out[None])[0], expand, depth=cfg.depth, top_k=cfg.top_k,
                                 max_nodes=cfg.max_nodes, past=base, to_target=self._token_ids)
        extra = state.cache.get_seq_length() - base
        if extra > 0:  # drop the tree entries: only committed positions stay cached
            state.cache.crop(-extra)
        return tree, state

    def observe(self, state: EagleState, verified: Verified) -> EagleState:
        with torch.inference_mode():
            pending = torch.cat([state.pending, self._features(verified.hidden)])
        return EagleState(state.cache, state.length, pending, None)


def adapter(drafter: Eagle1Head | Eagle3Head, decode: dict, target, tree: dict[str, int]) -> EagleTreeDrafter:
    """The drafter of a loaded folder, growing the tree stored with it (``decode["tree"]``; the default
    tree for folders that store none) with the fields of ``tree`` replaced."""
    return EagleTreeDrafter(drafter, target.model, TreeConfig(**{**decode.get("tree", {}), **tree}))
