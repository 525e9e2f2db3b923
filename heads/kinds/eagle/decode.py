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

Batches (:meth:`EagleTreeDrafter.propose_batch`): each row keeps its own cache (rows differ in length),
and a step's proposals for B rows merge them into one batch cache, padded to the longest row: the
rows' pending features are fed in one forward (padded to the most pending, the padding masked), then
the trees grow in lockstep (:func:`~selfdraft.inference.tree.grow_dynamic_trees`), one forward per
depth for every row, each row feeding its ``top_k`` nodes at its own positions. Cached keys are stored
rotated, so where the padding sits does not matter as long as the mask hides it. Each row's cache then
gains only its caught-up entries; the batch cache, with the tree entries, is dropped. A row's tree is
the one its own :meth:`~EagleTreeDrafter.propose` grows, up to the float rounding of a larger product.

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
from selfdraft.inference.tree import additive_mask, grow_dynamic_tree, grow_dynamic_trees


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
    dynamic tree of ``tree`` (depth, top-k, node budget); a batch's trees in one drafter forward per
    depth (module docstring)."""

    batched = True

    def __init__(self, drafter: Eagle1Head | Eagle3Head, target_model, tree: TreeConfig = TreeConfig()):
        self.config = tree
        self.max_nodes = tree.most_nodes
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
        # A sliding-window draft layer (a target family's own) drops its oldest entries as it grows: padding
        # a batch cache would drop real ones, so such a drafter proposes row by row.
        self.batched = not any(layer.is_sliding for layer in DynamicCache(config=self.drafter.layer_config).layers)

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

    def _following(self, state: EagleState, sequence) -> list[int]:
        """The tokens that follow the state's pending features in ``sequence`` (one per feature)."""
        m = state.pending.shape[0]
        tokens = list(sequence[state.length + 1:state.length + 1 + m])
        if len(tokens) != m:
            raise SelfdraftError(f"EAGLE state out of step: {m} pending target features but {len(tokens)} tokens "
                                 "after them; propose() must get the sequence this state observed (start/observe)")
        return tokens

    @torch.inference_mode()
    def _catch_up(self, state: EagleState, sequence) -> EagleState:
        """Feed the pending target features with the tokens that followed them (causal)."""
        m = state.pending.shape[0]
        if m == 0:
            return state
        tokens = torch.tensor(self._following(state, sequence), dtype=torch.long, device=self.device)
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

    @torch.inference_mode()
    def propose_batch(self, states, sequences):
        """Every row's tree in one drafter forward per depth, plus one for the rows' pending features
        (module docstring); each returned state holds its row's committed positions only. A batch of one
        is :meth:`propose`."""
        if len(states) == 1 or not self.batched:
            return super().propose_batch(states, sequences)
        rows, device = len(states), self.device
        lengths = [s.length for s in states]
        counts = [s.pending.shape[0] for s in states]
        width, most = max(lengths), max(counts)  # W cached columns, M pending positions
        cache = self._merged(states, width)
        valid = torch.arange(width, device=device)[None] < torch.tensor(lengths, device=device)[:, None]  # (B, W)
        if most:
            valid, outs = self._catch_up_batch(states, sequences, cache, valid)
        else:
            outs = [None] * rows
        roots, caught_up = [], []
        for b, (state, m, out) in enumerate(zip(states, counts, outs)):
            if m:  # the row's caught-up keys and values join its own cache: its committed entries only
                for i, layer in enumerate(cache.layers):
                    state.cache.update(layer.keys[b:b + 1, :, width:width + m], layer.values[b:b + 1, :, width:width + m], i)
                state = EagleState(state.cache, state.length + m, state.pending[:0], out)
            roots.append(state.out)
            caught_up.append(state)
        last = torch.stack(roots)[:, None]  # (B, 1, H): the outputs whose predictions the next expanded nodes are

        def expand(tokens, parent_rows, positions, visible):  # (B, k) each, visible (B, k, W + M + S + k)
            nonlocal last
            feature = last.gather(1, parent_rows[..., None].expand(-1, -1, last.shape[-1]))  # (B, k, H)
            last = self.drafter(feature, self.embed(tokens), positions, additive_mask(visible, self.dtype), cache=cache)
            return self._log_probs(last)  # (B, k, V')

        cfg = self.config
        past = torch.tensor([s.length for s in caught_up], dtype=torch.long, device=device)
        trees = grow_dynamic_trees(self._log_probs(last[:, 0]), expand, depth=cfg.depth, top_k=cfg.top_k,
                                   max_nodes=cfg.max_nodes, past=past, cached=valid, to_target=self._token_ids)
        return list(zip(trees, caught_up))

    def _merged(self, states: list[EagleState], width: int) -> DynamicCache:
        """One batch cache over the rows' committed entries: row b's at columns 0..length_b - 1, zeros
        after them (hidden by the mask), each layer (B, heads, W, head dim)."""
        cache = DynamicCache(config=self.drafter.layer_config)
        if width == 0:
            return cache
        full = next(s for s in states if s.length == width)
        for i, layer in enumerate(full.cache.layers):
            keys = layer.keys.new_zeros(len(states), *layer.keys.shape[1:])  # (B, heads, W, head dim)
            values = layer.values.new_zeros(len(states), *layer.values.shape[1:])
            for b, state in enumerate(states):
                if state.length:
                    keys[b, :, :state.length] = state.cache.layers[i].keys[0]
                    values[b, :, :state.length] = state.cache.layers[i].values[0]
            cache.update(keys, values, i)
        return cache

    def _catch_up_batch(self, states, sequences, cache: DynamicCache,
                        valid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Feed every row's pending features (padded to the most, M) with the tokens that followed them
        in one forward on the batch cache (valid: (B, W) its committed columns). Returns the columns
        the tree may see, (B, W + M), and each row's output at its last fed position (None where it fed
        none)."""
        rows, device = len(states), self.device
        counts = [s.pending.shape[0] for s in states]
        most = max(counts)
        feature = states[0].pending.new_zeros(rows, most, states[0].pending.shape[-1])  # (B, M, H)
        tokens = torch.zeros(rows, most, dtype=torch.long)
        for b, (state, sequence, m) in enumerate(zip(states, sequences, counts)):
            if m:
                feature[b, :m] = state.pending
                tokens[b, :m] = torch.tensor(self._following(state, sequence), dtype=torch.long)
        step = torch.arange(most, device=device)
        positions = torch.tensor([s.length for s in states], device=device)[:, None] + step  # (B, M)
        real = step[None] < torch.tensor(counts, device=device)[:, None]  # (B, M)
        # Real positions see their row's cache and the block causally; padding sees itself only.
        block = ((step[None, :] <= step[:, None])[None] & real[:, :, None]) | torch.eye(most, dtype=torch.bool, device=device)
        visible = torch.cat([valid[:, None, :] & real[:, :, None], block], dim=2)  # (B, M, W + M)
        out = self.drafter(feature, self.embed(tokens.to(device)), positions, additive_mask(visible, self.dtype), cache=cache)
        return torch.cat([valid, real], dim=1), [out[b, m - 1] if m else None for b, m in enumerate(counts)]

    def observe(self, state: EagleState, verified: Verified) -> EagleState:
        with torch.inference_mode():
            pending = torch.cat([state.pending, self._features(verified.hidden)])
        return EagleState(state.cache, state.length, pending, None)


def adapter(drafter: Eagle1Head | Eagle3Head, decode: dict, target, tree: dict[str, int]) -> EagleTreeDrafter:
    """The drafter of a loaded folder, growing the tree stored with it (``decode["tree"]``; the default
    tree for folders that store none) with the fields of ``tree`` replaced."""
    return EagleTreeDrafter(drafter, target.model, TreeConfig(**{**decode.get("tree", {}), **tree}))
