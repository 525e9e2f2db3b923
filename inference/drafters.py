"""Drafters: anything that proposes a token tree for the current state, behind one interface, and the
drafters that need no training (none, prompt lookup, a separate draft model). Trained kinds bring
their own adapters (``selfdraft.heads.kinds``); ``selfdraft.inference.specs.make_drafter`` builds any
drafter from its spec.

A drafter keeps its own state explicitly: :meth:`Drafter.start` returns it, :meth:`Drafter.propose`
and :meth:`Drafter.observe` take it and return it. The decoding loop does not care which drafter it
drives; the tree shape (depth, branching, node budget) is the drafter's decode config.

Devices: a drafter computes on the target's device (:func:`on_target` moves its weights there and says
so) and hands the decoder a host-side :class:`~selfdraft.inference.tree.DraftTree`, read back in one
batched copy per proposal.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from copy import deepcopy
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from selfdraft.configs.decode import DRAFT_MODEL_TREE, PromptLookupConfig, TreeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.inference.session import CausalLMSession, StepOutput
from selfdraft.inference.tree import DraftTree, grow_dynamic_tree

logger = logging.getLogger(__name__)


@dataclass
class Verified:
    """What a verification step committed, for the drafter to learn its new state from.

    tokens: the new committed tokens (accepted draft tokens, then the target's bonus token).
    tree: the tree the target verified (None where the caller does not say).
    hidden: the target's hidden states (one (A + 1, D) tensor per layer the drafter asked for) at the
            root and the accepted positions: the features that produced ``tokens``.
    """

    tokens: list[int]
    hidden: tuple[torch.Tensor, ...] = ()
    tree: DraftTree | None = None
    """The tree the target verified: the proposal, or the part of it the drafting policy kept."""


def on_target(module: nn.Module, target_model, what: str, *, dtype: bool = True) -> nn.Module:
    """``module`` on the target's device and, with ``dtype``, in its dtype (floating tensors only: index
    buffers keep theirs): the module itself when it already is, else a converted copy (the caller's
    module is left as it was), with one logged line, so a drafter saved or loaded elsewhere meets the
    target as a logged conversion, never as a device or dtype mismatch in the middle of a forward."""
    device, wanted = target_model.device, target_model.dtype if dtype else None
    have = next(module.parameters())
    if have.device == device and (wanted is None or have.dtype == wanted):
        return module
    target = f"{device}/{wanted}" if wanted is not None else str(device)
    logger.info("%s converted from %s/%s to %s (the target's), as a copy", what, have.device, have.dtype, target)
    copy = deepcopy(module)
    return copy.to(device=device, dtype=wanted) if wanted is not None else copy.to(device=device)


class Drafter(ABC):
    """Proposes a draft tree below the root (the last committed token)."""

    name: str = "drafter"
    hidden_layers: tuple[int, ...] = ()
    """Target layers whose hidden states the drafter reads (transformers' hidden_states numbering)."""
    max_nodes: int = 0
    """The most draft nodes one proposal holds (0: it never drafts): the largest verification the
    drafting policy (inference/policy.py) needs the cost of."""
    batched: bool = False
    """Whether :meth:`propose_batch` drafts every row in one forward (so a batch of B rows costs less
    than B proposals) rather than row by row."""

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput) -> Any:
        """Begin a sequence: the target has just run its prefill on ``prompt_ids``. Returns the state."""
        return None

    @abstractmethod
    def propose(self, state: Any, sequence: Sequence[int]) -> tuple[DraftTree, Any]:
        """Draft below ``sequence[-1]`` (the root). ``sequence`` is the prompt and every committed token."""

    def propose_batch(self, states: Sequence[Any], sequences: Sequence[Sequence[int]]) -> list[tuple[DraftTree, Any]]:
        """:meth:`propose` for each row of a batch (row by row unless the drafter is :attr:`batched`)."""
        return [self.propose(state, sequence) for state, sequence in zip(states, sequences)]

    def observe(self, state: Any, verified: Verified) -> Any:
        """Update the state after a verification step committed ``verified.tokens``."""
        return state

    def step_seconds(self, state: Any) -> float | None:
        """The modelled cost of the proposal just made, for a drafter whose cost varies from step to step
        (a hybrid that skipped its drafter's forward); None: its measured constant cost applies."""
        return None


class NoDrafter(Drafter):
    """The vanilla baseline: no draft, one token per target forward, through the same loop."""

    name = "none"

    @classmethod
    def from_spec(cls, argument, target, options) -> "NoDrafter":
        return cls()

    def propose(self, state, sequence):
        return DraftTree.empty(), state


class PromptLookupDrafter(Drafter):
    """Copies what followed earlier occurrences of the sequence's last n tokens (prompt and output).

    The longest suffix n-gram (``max_ngram`` down to ``min_ngram``) that occurred before wins; its
    earliest occurrences come first (they accept more than the most recent first, by measurement:
    docs/results/decoding.md). Up to ``max_branches``
    distinct continuations are merged into one tree (a chain when 1).
    """

    name = "prompt-lookup"

    def __init__(self, config: PromptLookupConfig = PromptLookupConfig()):
        self.config = config
        self.max_nodes = min(config.max_nodes, config.num_tokens * config.max_branches)

    @classmethod
    def from_spec(cls, argument, target, options) -> "PromptLookupDrafter":
        return cls(options.prompt_lookup or PromptLookupConfig())

    def propose(self, state, sequence):
        cfg = self.config
        seq = np.asarray(sequence, dtype=np.int64)
        t = seq.size
        paths: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(cfg.max_ngram, t - 1), cfg.min_ngram - 1, -1):
            # Windows starting at 0..t-n-1: every earlier occurrence, excluding the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # (t - n, n)
            starts = np.flatnonzero((windows == seq[t - n :]).all(axis=1))
            for start in starts:
                follow = seq[start + n : start + n + cfg.num_tokens]
                key = tuple(follow.tolist())
                if key in seen:
                    continue
                seen.add(key)
                paths.append(list(key))
                if len(paths) == cfg.max_branches:
                    break
            if paths:
                break
        if not paths:
            return DraftTree.empty(), state
        tree = DraftTree.chain(paths[0]) if len(paths) == 1 else DraftTree.from_paths(paths)
        return tree.prune(max_depth=cfg.num_tokens, max_nodes=cfg.max_nodes), state


class DraftModelDrafter(Drafter):
    """A separate small causal LM with the target's tokenizer drafts greedily: a chain of ``depth``
    tokens (``top_k`` 1) or a tree that, at each depth, expands the ``top_k`` best nodes by
    cumulative draft log-probability into their ``top_k`` best children and finally keeps the best
    ``max_nodes`` (:func:`~selfdraft.inference.tree.grow_dynamic_tree`, on the draft model's device).
    The draft model's cache holds the committed tokens (from its first proposal on); tree nodes are
    cropped after each proposal, and the next proposal first feeds the newly committed tokens.
    """

    name = "draft-model"

    def __init__(self, model, tree: TreeConfig = DRAFT_MODEL_TREE, target_vocab_size: int | None = None):
        self.model = model
        self.config = tree
        self.max_nodes = tree.most_nodes
        self.vocab_size = target_vocab_size or model.config.get_text_config(decoder=True).vocab_size

    @classmethod
    def from_spec(cls, argument: str, target, options) -> "DraftModelDrafter":
        """``draft-model:SPEC``: the model SPEC (loaded in the target's dtype, on its device), with the tree
        :data:`DRAFT_MODEL_TREE` and the fields ``options.tree`` changes."""
        import dataclasses

        from selfdraft.heads.target import load_target
        from selfdraft.inference.drafter_specs import tree_overrides

        draft = load_target(argument, dtype=target.dtype, device=str(target.device))
        return cls.for_target(draft, target, dataclasses.replace(DRAFT_MODEL_TREE, **tree_overrides(options.tree)))

    @classmethod
    def for_target(cls, draft, target, tree: TreeConfig = DRAFT_MODEL_TREE) -> "DraftModelDrafter":
        """Check that ``draft`` (a loaded Target) shares ``target``'s tokenizer, then wrap it, moved to the
        target's device if it is elsewhere (its dtype is its own: its logits are read in float32)."""
        mine, theirs = draft.identity, target.identity
        if not mine.tokenizer_hash or mine.tokenizer_hash != theirs.tokenizer_hash:
            raise SelfdraftError(
                f"draft model {mine.name!r} does not use the tokenizer of target {theirs.name!r} "
                f"(tokenizer hash {mine.tokenizer_hash[:12] or 'missing'} vs {theirs.tokenizer_hash[:12] or 'missing'}); "
                "a draft model must share the target's tokenizer"
            )
        model = on_target(draft.model, target.model, f"draft model {mine.name!r}", dtype=False)
        return cls(model, tree, target_vocab_size=theirs.vocab_size)

    def start(self, prompt_ids, prefill):
        """An empty draft cache: the draft model reads the text at its first proposal, so a request whose
        drafting policy never drafts (a drafter that does not pay) costs no draft-model prefill."""
        return CausalLMSession(self.model)

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(m, V_draft) -> (m, V_target) float32 log-probabilities; rows beyond the target's vocab are dropped."""
        return torch.log_softmax(logits[:, : self.vocab_size].float(), dim=-1)

    def propose(self, session: CausalLMSession, sequence):
        cfg = self.config
        if session.length >= len(sequence):  # a second proposal from the same sequence: feed the root again
            session.crop(len(sequence) - 1)
        if session.length == 0 and len(sequence) > 1:  # the first proposal: the text before the root at once
            session.prefill(sequence[:-1])
        out = session.extend(sequence[session.length :], last_only=True)  # catch up: ends with the root
        base = session.length  # committed tokens in the draft cache, root included

        def expand(tokens, rows, positions, visible):
            return self._log_probs(session.feed_tree_nodes(tokens, positions, visible).logits)

        top_k = cfg.top_k if session.trees else 1  # a recurrent draft model drafts a chain
        tree = grow_dynamic_tree(self._log_probs(out.logits[-1:])[0], expand, depth=cfg.depth, top_k=top_k,
                                 max_nodes=cfg.max_nodes, past=base)
        session.crop(base)
        return tree, session
