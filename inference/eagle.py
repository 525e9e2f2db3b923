"""Decoding with EAGLE drafters: EAGLE-2 dynamic trees over the drafter's own small cache.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from selfdraft.configs.decode import DynamicTreeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.eagle import EagleDrafter
from selfdraft.heads.small_batch import use_small_batch_matmul
from selfdraft.inference.drafters import Drafter, Verified
from selfdraft.inference.session import StepOutput
from selfdraft.inference.tree import DraftTree, additive_mask


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
    name = "eagle"

    def __init__(self, drafter: EagleDrafter, target_model, config: DynamicTreeConfig = DynamicTreeConfig()):
        self.config = config.validate()
        self.drafter = drafter.to(device=target_model.device, dtype=target_model.dtype).eval()
        use_small_batch_matmul(self.drafter)  # top_k rows per draft step
        self.embed = target_model.get_input_embeddings()
        self.lm_head = target_model.get_output_embeddings()
        text = target_model.config.get_text_config()
        if drafter.hidden_size != text.hidden_size or drafter.vocab_size != text.vocab_size:
            raise SelfdraftError(f"this {drafter.kind} drafter is for hidden size {drafter.hidden_size} and vocabulary "
                                 f"{drafter.vocab_size}; the target has {text.hidden_size} and {text.vocab_size}")
        self.name = drafter.kind
        self.hidden_layers = (text.num_hidden_layers,) if drafter.kind == "eagle" else tuple(drafter.aux_layers)
        self.device, self.dtype = target_model.device, target_model.dtype
        self.draft_ids = drafter.draft_to_target().to(self.device) if drafter.kind == "eagle3" else None

    def _features(self, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Target hidden states (one (m, H) per requested layer) -> drafter input features (m, H)."""
        if self.drafter.kind == "eagle":
            return hidden[0]
        return self.drafter.fuse(torch.cat(hidden, dim=-1))

    def _run(self, state: EagleState, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """Feed m (feature, token) pairs; returns the drafter outputs (m, H)."""
        out = self.drafter(feature[None], self.embed(tokens[None].to(self.device)), positions[None].to(self.device),
                           mask, cache=state.cache)
        return out[0]

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """(m, H) outputs -> (m, V or V') draft log-probabilities."""
        lm_head = self.lm_head if self.drafter.kind == "eagle" else None
        return torch.log_softmax(self.drafter.logits(out, lm_head).float(), dim=-1)

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
        tokens = torch.as_tensor(list(sequence[state.length + 1:state.length + 1 + m]), dtype=torch.long)
        if tokens.numel() != m:
            raise RuntimeError(f"EAGLE state out of step: {m} pending features, {tokens.numel()} tokens")
        positions = torch.arange(state.length, state.length + m)
        mask = None
        if state.length and m > 1:  # causal over the new block, everything cached is visible
            visible = torch.ones(m, state.length + m, dtype=torch.bool)
            visible[:, state.length:] = torch.ones(m, m, dtype=torch.bool).tril()
            mask = additive_mask(visible, self.dtype)
        out = self._run(state, state.pending, tokens, positions, mask)
        return EagleState(state.cache, state.length + m, state.pending[:0], out[-1])

    @torch.inference_mode()
    def propose(self, state: EagleState, sequence):
        state = self._catch_up(state, sequence)
        cfg = self.config
        base = state.length
        # Candidate nodes: token (target id), parent candidate index (-1: root), cumulative score,
        # depth, and for expanded nodes the predicted feature and cache slot.
        lp = self._log_probs(state.out[None])[0]  # (V,)
        top = torch.topk(lp, cfg.top_k)
        tokens = self._token_ids(top.indices).tolist()
        parents = [-1] * cfg.top_k
        scores = top.values.tolist()
        depths = [1] * cfg.top_k
        slot: dict[int, int] = {}  # candidate -> cache position of its fed entry
        frontier = list(range(cfg.top_k))
        feature_of = {i: state.out for i in frontier}  # the feature each frontier node is fed with
        for depth in range(2, cfg.depth + 1):
            # Expand the best top_k nodes of the previous depth, all in one drafter forward.
            expand = sorted(frontier, key=lambda i: -scores[i])[: cfg.top_k]
            m = len(expand)
            start = base + len(slot)
            visible = torch.zeros(m, start + m, dtype=torch.bool)
            visible[:, :base] = True
            for row, i in enumerate(expand):
                j = parents[i]
                while j >= 0:  # ancestors were all expanded earlier
                    visible[row, slot[j]] = True
                    j = parents[j]
                visible[row, start + row] = True
            for row, i in enumerate(expand):
                slot[i] = start + row
            feats = torch.stack([feature_of[i] for i in expand])  # (m, H)
            toks = torch.tensor([tokens[i] for i in expand], dtype=torch.long)
            positions = torch.tensor([base - 1 + depths[i] for i in expand], dtype=torch.long)
            out = self._run(state, feats, toks, positions, additive_mask(visible, self.dtype))  # (m, H)
            child = torch.topk(self._log_probs(out), cfg.top_k)  # (m, k)
            child_ids = self._token_ids(child.indices)
            frontier = []
            for row, i in enumerate(expand):
                for c in range(cfg.top_k):
                    tokens.append(int(child_ids[row, c]))
                    parents.append(i)
                    scores.append(scores[i] + float(child.values[row, c]))
                    depths.append(depth)
                    feature_of[len(tokens) - 1] = out[row]
                    frontier.append(len(tokens) - 1)
        extra = state.cache.get_seq_length() - base
        if extra > 0:  # drop the tree entries: only committed positions stay cached
            state.cache.crop(-extra)
        # Keep the best max_nodes candidates; order parents first (depth, then score).
        keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i]))[: cfg.max_nodes]
        keep.sort(key=lambda i: (depths[i], -scores[i]))
        index = {c: n for n, c in enumerate(keep)}
        tree = DraftTree(torch.tensor([tokens[i] for i in keep], dtype=torch.long),
                         torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in keep], dtype=torch.long))
        return tree, state

    def observe(self, state: EagleState, verified: Verified) -> EagleState:
        with torch.inference_mode():
            pending = torch.cat([state.pending, self._features(verified.hidden)])
        return EagleState(state.cache, state.length, pending, None)


def drafter_from_folder(folder, target, config: DynamicTreeConfig | None = None) -> EagleTreeDrafter:
    """An EAGLE drafter from an exported folder, refused unless it was trained for ``target``; it decodes
    with ``config`` or else the dynamic tree stored with it."""
    from selfdraft.heads.io import load_drafter

    drafter, record = load_drafter(folder, target.identity)
    if record.kind not in ("eagle", "eagle3"):
        raise SelfdraftError(f"{folder} holds a {record.kind} drafter, not an EAGLE one")
    if config is None:
        config = DynamicTreeConfig(**record.decode["tree"]) if "tree" in record.decode else DynamicTreeConfig()
    return EagleTreeDrafter(drafter, target.model, config)
