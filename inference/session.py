"""One sequence of a transformers causal LM: a draft model's session (inference/batch.py's
``BatchSession`` feeds the target, at every batch size), and the batch-1 :class:`TargetSession`
protocol that the decoding loop also takes (a scripted stub in the tests; ``decode.OneRow``).

A :class:`CausalLMSession` is the per-sequence state of one model: its cache and how many tokens it holds. It feeds tokens (plain, or a tree with 4D float masks and
explicit position ids), and compacts the cache to an accepted path. It is created by the decoding
loop for one generation and passed around; nothing is stored on the model. The cache, the masks per
layer kind and the rollback of recurrent layers come from the target's
:class:`~selfdraft.heads.target_layers.TargetLayers`.

Only the public API is used: ``cache=``, ``Cache.crop``, ``Cache.activate_past_recording``,
``cache.layers[i].keys/values``, ``position_ids``, 4D additive masks, ``logits_to_keep`` and
``output_hidden_states``.

Every tensor it feeds is made on the model's device (``device=`` at creation): ids and positions from
host lists in one copy, the tree mask there from the (M, M) ancestor pattern, the compaction index
there. It reads nothing back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.target_layers import RECURRENT_HISTORY, TargetLayers
from selfdraft.inference.tree import DraftTree, TreeBuffers


@dataclass
class StepOutput:
    """What one forward returns.

    logits: (M, V) at the fed positions (only the last position after a prefill).
    hidden: hidden states of the requested layers at the fed positions, each (M, D); index i of the
            tuple is the i-th requested layer (transformers' numbering: 0 is the embedding output,
            num_layers the final normed output). Empty when no layer was requested.
    """

    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...] = ()


class TargetSession(Protocol):
    """What the decoding loop needs from the target (a stub implements it in the tests)."""

    length: int
    trees: bool
    """Whether a branching tree can be verified in one forward (False: the loop sends chains only)."""

    def prefill(self, input_ids: Sequence[int]) -> StepOutput: ...

    def verify(self, root: int, tree: DraftTree, buffers: TreeBuffers) -> StepOutput: ...

    @torch.inference_mode()
    def commit(self, keep: Sequence[int]) -> None: ...


class CausalLMSession:
    """Cache state of one sequence (batch 1) of a transformers causal LM.

    The target's layer kinds (:class:`~selfdraft.heads.target_layers.TargetLayers`) decide the cache and
    the masks: a target with only full attention feeds chains with no mask (the model's own causal
    one); windows get explicit masks on every forward; recurrent layers verify chains only
    (``trees`` is False) and roll back through recorded states.
    """

    def __init__(self, model, hidden_layers: Sequence[int] = ()):
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        self.layers = TargetLayers.of(model)
        self.cache = self.layers.new_cache(model)
        self.length = 0  # tokens whose key/values are in the cache
        self._tree_base = 0  # cache length before the last verify
        self.device = model.device
        self.mask_dtype = next(model.parameters()).dtype

    @property
    def trees(self) -> bool:
        """Whether a branching tree can be verified in one forward (False: chains only)."""
        return self.layers.trees

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor | None, visible: torch.Tensor | None, keep_logits: int):
        """ids (T,), positions (T,) or None (the next T positions), visible (T, length + T) bool or None
        (plain causal attention): all on the model's device."""
        mask = None
        if visible is not None or self.layers.windowed:
            t = ids.numel()
            if positions is None:
                positions = torch.arange(self.length, self.length + t, device=self.device)
            keys = torch.arange(self.length + t, device=self.device)  # one row: slot i holds position i
            if visible is None:
                visible = keys[None, :] <= positions[:, None]
            mask = self.layers.masks(visible[None], positions[None], keys[None], self.mask_dtype)
        out = self.model(
            input_ids=ids[None],
            position_ids=None if positions is None else positions[None],
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=keep_logits,
            output_hidden_states=bool(self.hidden_layers),
        )
        hidden = tuple(out.hidden_states[i][0] for i in self.hidden_layers) if self.hidden_layers else ()
        return StepOutput(logits=out.logits[0], hidden=hidden)

    @torch.inference_mode()
    def prefill(self, input_ids: Sequence[int]) -> StepOutput:
        """Feed a prompt (T tokens) into an empty cache; logits (1, V) at the last position only,
        hidden states (T, D) at every position."""
        if self.length:
            raise SelfdraftError(f"prefill needs an empty session, this one holds {self.length} tokens: make a new "
                                 "CausalLMSession per sequence, or crop(0) first, or extend() to continue this one")
        ids = torch.tensor(list(input_ids), dtype=torch.long, device=self.device)
        out = self._forward(ids, None, None, keep_logits=1)
        self.length = ids.numel()
        self.layers.start_recording(self.cache)
        return out

    @torch.inference_mode()
    def extend(self, input_ids: Sequence[int], *, last_only: bool = False) -> StepOutput:
        """Append tokens to the cache as a causal continuation; logits (T, V) at every fed position, or (1, V)
        at the last with ``last_only`` (a catch-up that reads only the next token's: no vocabulary
        projection of the others)."""
        ids = torch.tensor(list(input_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(self.length, self.length + ids.numel(), device=self.device)
        out = self._forward(ids, positions, None, keep_logits=1 if last_only else 0)
        self.length += ids.numel()
        return out

    @torch.inference_mode()
    def verify(self, root: int, tree: DraftTree, buffers: TreeBuffers) -> StepOutput:
        """Feed the root and the tree's N nodes (M positions) in one forward; logits (M, V).

        The cache then holds all M positions; :meth:`commit` keeps the accepted path only.
        """
        ids_positions = torch.tensor([[int(root), *tree.token_ids], [self.length + d for d in buffers.depths]],
                                     dtype=torch.long, device=self.device)  # (2, M)
        # A chain (including the bare root) is ordinary causal attention.
        visible = None
        if not buffers.is_chain:
            if not self.trees:
                raise SelfdraftError(f"the {self.layers.family} target has recurrent layers: it verifies chains only "
                                     "(DraftTree.best_path), not a branching tree")
            ancestors = buffers.ancestors.to(self.device)
            visible = torch.cat([ancestors.new_ones(ancestors.shape[0], self.length), ancestors], dim=1)
        out = self._forward(ids_positions[0], ids_positions[1], visible, keep_logits=0)
        self._tree_base = self.length
        self.length += buffers.size
        return out

    @torch.inference_mode()
    def feed_tree_nodes(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> StepOutput:
        """Append nodes of a growing tree: tokens (m,), positions (m,), visible (m, length + m) bool (all on
        the model's device): which cached or new positions each new token may attend to. Logits (m, V)."""
        out = self._forward(tokens, positions, visible, keep_logits=0)
        self.length += tokens.numel()
        return out

    @torch.inference_mode()
    def commit(self, keep: Sequence[int]) -> None:
        """Keep only the tree positions ``keep`` (root first, then the accepted path) of the last verify.

        Their key/values move to the front of the tree block, in order; the rest is cropped.
        """
        base = self._tree_base
        keep = list(keep)
        if keep != list(range(len(keep))):
            src = torch.tensor([base + i for i in keep], dtype=torch.long, device=self.device)
            dst = slice(base, base + len(keep))
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is None:  # a recurrent or KV-sharing layer (chains only reach here)
                    continue
                layer.keys[..., dst, :] = layer.keys[..., src, :]  # (B, H, S, D)
                layer.values[..., dst, :] = layer.values[..., src, :]
        self.crop(base + len(keep))

    @torch.inference_mode()
    def crop(self, new_length: int) -> None:
        """Drop cached tokens beyond the first ``new_length``. A recurrent target is cropped even by 0: its
        crop also drops the states recorded since the last one (transformers' ``Cache.crop``)."""
        drop = self.length - new_length
        if drop > 0 or (self.layers.recurrent and drop == 0):
            if self.layers.recurrent and drop > RECURRENT_HISTORY:
                raise SelfdraftError(f"cannot roll the {self.layers.family} target back by {drop} tokens: its recurrent "
                                     f"layers record the last {RECURRENT_HISTORY} states")
            self.cache.crop(-drop)
        self.length = new_length
