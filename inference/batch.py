"""The target's session: B prompts in one target forward per step, each row with its own tree (batch 1
is a batch of one; the loop is inference/decode.py's ``batched_decode``).

Why a batch: a step of a small model on a CPU (or any model on a GPU) is bound by reading the weights,
so B rows cost far less than B steps; speculative decoding spends the same spare compute on draft
tokens, which is why its gain shrinks as the batch grows (inference/policy.py weighs it at the live batch size).

The cache (a :class:`BatchSession`): one ``DynamicCache`` of shape (B, H, S, D) whose slots are shared
by position in the tensor, not by position in the text. Each row has its own length (its next position
id, fed explicitly) and a (B, S) validity mask: which slots hold one of its committed tokens. A step
feeds every row's tree (padded to the largest, M positions) after the S slots; committing moves each
row's accepted path to the front of the new block and marks the rest of the block invalid for that
row, so a row that accepted fewer tokens than another leaves masked holes instead of forcing a copy
of the whole cache. The slot count grows by the most tokens any row kept per step (a few per step),
and rows that finish leave the batch at once (their cache rows are dropped, and slot columns no row
still uses are cut), so the holes stay small. A paged cache would avoid them at the price of a kernel
transformers does not have on the CPU.

Padded positions (prompts shorter than the longest, trees smaller than the largest) attend to
themselves only, so every row of the additive mask has an allowed entry and nothing padded is ever
visible to a real token: each row's logits are what that row's own batch-1 forward computes, up to
the float rounding of a larger matrix product.

Exactness is per row, as at batch 1: greedy rows take the argmax path; sampled rows each have their
own random generator (seeded per row) and go through the same verification rule, so each row keeps
the target's distribution. The drafter keeps one state per row (``Drafter.start`` / ``propose`` /
``observe`` with explicit state, so one drafter object serves every row); a step's proposals are one
``Drafter.propose_batch`` call: one drafter forward for every row where the drafter is ``batched`` (the
block drafters; EAGLE-1 and EAGLE-3 one per tree depth, all rows in lockstep), row by row otherwise.
"""

from __future__ import annotations

from typing import Sequence

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.target_layers import TargetLayers
from selfdraft.inference.session import StepOutput
from selfdraft.inference.tree import DraftTree, TreeBuffers
from selfdraft.machine import available_host_bytes


class BatchSession:
    """Cache state of a batch of sequences of one transformers causal LM (see the module docstring)."""

    def __init__(self, model, hidden_layers: Sequence[int] = ()):
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        self.layers = TargetLayers.of(model)
        self.cache = self.layers.new_cache(model)
        self.device = model.device
        self.mask_dtype = next(model.parameters()).dtype
        self.lengths: list[int] = []
        """Per row: committed tokens, which is also the position id of its next token."""
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        """(B, S): the slots that hold a committed token of that row."""
        self.positions = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        """(B, S): the position id of the token in each slot (meaningful where ``valid``), for windowed masks."""
        self._base = 0  # slots before the last verify

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def trees(self) -> bool:
        """Whether branching trees can be verified in one forward (False: chains only, heads/target_layers.py)."""
        return self.layers.trees

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None, keep_logits,
                 padding: torch.Tensor | None = None):
        """ids, positions (B, T); visible (B, T, S + T) bool: which slots each fed token may attend to, or
        None where that is plain causal attention over every slot (a batch of one fed a chain: the
        model's own causal mask, as a forward without a cache would have it); padding (B, T) or None:
        the real tokens of a left-padded prefill."""
        mask = None
        if visible is not None or self.layers.windowed:
            keys = torch.cat([self.positions, positions], dim=1) if self.slots else positions  # (B, S + T)
            if visible is None:
                visible = keys[:, None, :] <= positions[:, :, None]
            mask = self.layers.masks(visible, positions, keys, self.mask_dtype, padding)
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=self.cache, use_cache=True,
                          logits_to_keep=keep_logits, output_hidden_states=bool(self.hidden_layers))

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[StepOutput]:
        """Feed B prompts, left-padded to the longest, into an empty cache. Per row: logits (1, V) at its
        last position, hidden states (T_i, D) at every one of its positions.

        Left padding, so that a recurrent layer's state (heads/target_layers.py) sees zeros before a row's
        prompt, as at batch 1, and never padding after it; attention sees the padding nowhere."""
        if self.rows:
            raise SelfdraftError("prefill needs an empty BatchSession: make a new one per batch")
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        ids = ids.to(self.device)
        slot = torch.arange(width, device=self.device)
        start = width - torch.tensor(lengths, device=self.device)[:, None]  # (B, 1): each row's first slot
        real = slot[None, :] >= start  # (B, T)
        positions = (slot[None, :] - start).clamp(min=0)  # (B, T)
        visible = None  # a batch of one: plain causal attention
        if len(prompts) > 1:
            causal = slot[None, :] <= slot[:, None]  # (T, T): query j sees keys k <= j
            visible = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)[None]
        padded = None if min(lengths) == width else real.to(self.mask_dtype)
        out = self._forward(ids, positions, visible, 1, padding=padded)
        self.lengths, self.valid, self.positions = lengths, real, positions
        self.layers.start_recording(self.cache)
        return [StepOutput(logits=out.logits[i, -1:],
                           hidden=tuple(out.hidden_states[layer][i, width - n:] for layer in self.hidden_layers))
                for i, n in enumerate(lengths)]

    @torch.inference_mode()
    def verify(self, roots: Sequence[int], trees: Sequence[DraftTree], buffers: Sequence[TreeBuffers]) -> list[StepOutput]:
        """Feed each row's root and tree (padded to the largest, M positions) in one forward. Per row: logits
        (M_i, V) and hidden states (M_i, D) of its own positions. :meth:`commit` keeps the accepted paths."""
        rows, past = self.rows, self.slots
        if not self.trees and not all(b.is_chain for b in buffers):
            raise SelfdraftError(f"the {self.layers.family} target has recurrent layers: it verifies chains only "
                                 "(DraftTree.best_path), not a branching tree")
        sizes = [b.size for b in buffers]
        width = max(sizes)
        host = torch.zeros(2, rows, width, dtype=torch.long)
        new = torch.zeros(rows, width, width, dtype=torch.bool)  # (B, M, M): tree positions each may see
        for i, (root, tree, b) in enumerate(zip(roots, trees, buffers)):
            m = sizes[i]
            host[0, i, :m] = torch.tensor([int(root), *tree.token_ids], dtype=torch.long)
            host[1, i, :m] = torch.tensor(b.depths, dtype=torch.long) + self.lengths[i]
            host[1, i, m:] = self.lengths[i]
            new[i, :m, :m] = b.ancestors.cpu()
            new[i, m:, m:] = torch.eye(width - m, dtype=torch.bool)  # padding sees itself only
        host = host.to(self.device)
        if rows == 1 and buffers[0].is_chain:  # every slot is the row's, in order: plain causal attention
            visible = None
        else:
            real = torch.arange(width, device=self.device)[None, :] < torch.tensor(sizes, device=self.device)[:, None]
            cached = self.valid[:, None, :] & real[:, :, None]  # (B, M, S): real positions see their row's tokens
            visible = torch.cat([cached, new.to(self.device)], dim=2)
        out = self._forward(host[0], host[1], visible, 0)
        self._base = past
        self.valid = torch.cat([self.valid, torch.zeros(rows, width, dtype=torch.bool, device=self.device)], dim=1)
        self.positions = torch.cat([self.positions, host[1]], dim=1)
        return [StepOutput(logits=out.logits[i, :m], hidden=tuple(out.hidden_states[layer][i, :m]
                                                                  for layer in self.hidden_layers))
                for i, m in enumerate(sizes)]

    @torch.inference_mode()
    def commit(self, keeps: Sequence[Sequence[int]]) -> None:
        """Per row, keep only the tree positions ``keeps[i]`` (root first, then the accepted path) of the
        last verify: they move to the front of the new block, in order; the block is cut to the longest."""
        base, most = self._base, max(len(k) for k in keeps)
        if not all(list(k) == list(range(len(k))) for k in keeps):  # a row kept a branch: move its path forward
            index = torch.tensor([[base + j for j in k] + [base + k[-1]] * (most - len(k)) for k in keeps],
                                 dtype=torch.long, device=self.device)  # (B, K); padding repeats a kept slot
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is None:  # a layer that shares another's keys
                    continue
                for states in (layer.keys, layer.values):  # (B, H, S, D); latent attention: D differs between them
                    b, h, _, d = states.shape
                    states[:, :, base: base + most] = states.gather(2, index[:, None, :, None].expand(b, h, most, d))
        if self.layers.recurrent:  # each row's recurrent state from its own count; attention cut to the longest
            self.layers.keep_rows(self.cache, self.slots - base, [len(k) for k in keeps])
        elif self.slots > base + most:  # the kept slots lead the block: cut it to the longest
            self.cache.crop(-(self.slots - base - most))
        counts = torch.tensor([len(k) for k in keeps], device=self.device)
        column = torch.arange(most, device=self.device)[None, :]
        kept = column < counts[:, None]
        self.valid = torch.cat([self.valid[:, :base], kept], dim=1)
        start = torch.tensor(self.lengths, device=self.device)[:, None]
        self.positions = torch.cat([self.positions[:, :base], start + column], dim=1)
        self.lengths = [n + len(k) for n, k in zip(self.lengths, keeps)]

    @torch.inference_mode()
    def select(self, rows: Sequence[int]) -> None:
        """Keep only these rows (in this order), and only the slot columns some kept row still uses."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        valid = self.valid.index_select(0, index)
        used = valid.any(dim=0)
        columns = used.nonzero().squeeze(1) if not bool(used.all()) else None
        for layer in self.cache.layers:
            layer.reorder_cache(index)  # index_select over rows, recurrent states too
            if columns is not None and getattr(layer, "keys", None) is not None:
                layer.keys, layer.values = layer.keys[:, :, columns], layer.values[:, :, columns]
        self.valid = valid if columns is None else valid[:, columns]
        positions = self.positions.index_select(0, index)
        self.positions = positions if columns is None else positions[:, columns]
        self.lengths = [self.lengths[i] for i in rows]


def kv_bytes_per_row(model, tokens: int) -> int:
    """Bytes of the key/value cache of one row holding ``tokens`` tokens."""
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * tokens * next(model.parameters()).element_size()


def free_bytes(device) -> int:
    """Memory the device can still give: CUDA's free memory, else the host's MemAvailable."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    available = available_host_bytes()
    return 1 << 62 if available is None else available  # unknown: no limit


def check_batch_fits(model, batch: int, tokens: int, *, share: float = 0.8) -> None:
    """Refuse, before allocating, a batch whose key/value cache (plus its logits) would take more than
    ``share`` of the memory left on the model's device, naming the largest batch that fits."""
    text = model.config.get_text_config()
    row = kv_bytes_per_row(model, tokens) + 4 * tokens * text.vocab_size  # the cache, and float logits
    budget = share * free_bytes(model.device)
    if batch * row > budget:
        fits = int(budget // row)
        raise SelfdraftError(f"a batch of {batch} rows of {tokens} tokens needs about {batch * row / 2**30:.1f} GiB for its "
                             f"key/value cache and logits, more than {share:.0%} of the {budget / share / 2**30:.1f} GiB left "
                             f"on {model.device}; the largest batch that fits is {fits}")
