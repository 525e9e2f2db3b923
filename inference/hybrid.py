"""Copy drafting and hybrid drafting: what the text itself predicts, merged with what a drafter predicts.

:class:`CopyDrafter` drafts the way SuffixDecoding does (arXiv 2411.04975), over one request's prompt and
output: it finds the longest suffix of the sequence (up to ``max_pattern`` tokens) that occurred
before, counts what followed its most recent occurrences, and proposes the tree of those continuations,
each node valued by the share of occurrences that continued that way (smoothed by 1 / the matched
length, so a continuation seen once after a one-token match is worth 1/2 and one after a long match
nearly 1). Unlike prompt lookup (inference/drafters.py), whose trees are the first few matches, the
tree holds the frequent continuations and its values say how far to trust them.

:class:`HybridDrafter` merges a copy tree and a drafter's tree (any drafter: a trained kind, a draft
model) into one verification tree per step:

- Each source's node values are calibrated per request: a running ratio of the source's accepted nodes
  to the sum of the values it predicted for the nodes verified (one pseudo-count ``prior`` at 1), so a
  node's value estimates the probability that the target accepts it. A drafter whose trees carry no
  values (Medusa) counts each node as 1 before calibration: its node acceptance rate.
- The two trees are merged as a trie (a path both propose is one path, valued by the larger value);
  the nodes with the highest values fill the node budget, so the budget is split by each source's
  expected accepted tokens; the drafting policy then cuts the set to the size that pays on this
  machine's costs (:func:`~selfdraft.inference.policy.value_cut`, the drafter's cost counted when it ran).
- The drafter rests while the copy tree makes it not worth its cost: it pays while the tokens it would
  add, (1 - c) * g, are a larger share of the copy tree's tokens (1 + the sum of its values) than its
  cost, D + T(n + k + 1) - T(n + 1), is of the copy step's cost T(n + 1); c is the copy's best calibrated
  depth-1 value, g the drafter's running count of accepted tokens copying had not proposed, per step it
  ran, D its measured proposal cost, n and k the copy's and the drafter's node counts, T the cost curve.
  While it does not pay, it runs only on the probes of the policy's back-off rule
  (:class:`~selfdraft.inference.policy.Backoff`: after 4 steps, then ever more rarely while it stays
  far from paying), so g follows the request and a drafter that adds nothing costs about one run in 64
  steps.

All decisions read the sequence and what the target accepted, never a clock during decoding, so a
seeded sampled run is reproducible. Exact like every drafter: the merged tree is a tree of distinct
children whose tokens do not depend on the target's pending step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from selfdraft.configs.decode import CopyConfig, HybridConfig, PromptLookupConfig
from selfdraft.errors import SelfdraftError
from selfdraft.inference.drafters import Drafter, Verified
from selfdraft.inference.costs import COST_TOKENS, CostSurface, draft_cost, pays, verify_cost
from selfdraft.inference.policy import Backoff
from selfdraft.inference.tree import DraftTree

COPY, MODEL = 0, 1  # the two sources of a hybrid tree


def longest_suffix_match(seq: np.ndarray, max_pattern: int) -> tuple[int, np.ndarray]:
    """(n, ends): the longest n <= ``max_pattern`` such that the last n tokens of ``seq`` occurred
    earlier, and the index of the last token of each earlier occurrence (ascending); (0, empty) when
    even the last token is new."""
    t = seq.size
    if t < 2:
        return 0, np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(seq[:-1] == seq[-1])
    n = 1 if ends.size else 0
    while ends.size and n < min(max_pattern, t - 1):
        ends_longer = ends[ends >= n]
        ends_longer = ends_longer[seq[ends_longer - n] == seq[t - 1 - n]]
        if not ends_longer.size:
            break
        ends, n = ends_longer, n + 1
    return n, ends


class CopyDrafter(Drafter):
    """Copies the frequent continuations of the longest earlier occurrence of the sequence's suffix
    (see the module docstring); its trees carry the continuation frequencies as node values."""

    name = "copy"

    def __init__(self, config: CopyConfig = CopyConfig()):
        self.config = config
        self.max_nodes = config.max_nodes

    @classmethod
    def from_spec(cls, argument, target, options) -> "CopyDrafter":
        return cls()

    def propose(self, state, sequence):
        cfg = self.config
        seq = np.asarray(sequence, dtype=np.int64)
        n, ends = longest_suffix_match(seq, cfg.max_pattern)
        if n == 0:
            return DraftTree.empty(), state
        ends = ends[-cfg.max_occurrences:]
        tokens: list[int] = []
        parents: list[int] = []
        counts: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for e in ends.tolist():
            parent = -1
            for tok in seq[e + 1 : e + 1 + cfg.depth].tolist():
                node = index.get((parent, tok))
                if node is None:
                    node = index[(parent, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(parent)
                    counts.append(0)
                counts[node] += 1
                parent = node
        smoothing = 1.0 / n
        values = []
        for i, p in enumerate(parents):  # parents come before their children
            above, parent_count = (1.0, ends.size) if p < 0 else (values[p], counts[p])
            values.append(above * counts[i] / (parent_count + smoothing))
        return valued_tree(tokens, parents, values, cfg.max_nodes, cfg.min_value), state


def best_nodes(parents: list[int], values: list[float], max_nodes: int, min_value: float = 0.0) -> list[int]:
    """The ``max_nodes`` highest-valued nodes (at least ``min_value``) of a tree whose values do not rise
    along a path, by depth, then value (ties keep the earlier node, so the set is closed under ancestors)."""
    order = sorted((i for i in range(len(parents)) if values[i] >= min_value), key=lambda i: (-values[i], i))[:max_nodes]
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return sorted(order, key=lambda i: (depth[i], -values[i], i))


def valued_tree(tokens: list[int], parents: list[int], values: list[float], max_nodes: int,
                min_value: float = 0.0, keep: list[int] | None = None) -> DraftTree:
    """The tree of the nodes ``keep`` (default: :func:`best_nodes`), in that order, with their values."""
    keep = best_nodes(parents, values, max_nodes, min_value) if keep is None else keep
    if not keep:
        return DraftTree.empty()
    remap = {old: new for new, old in enumerate(keep)}
    return DraftTree.from_lists([tokens[i] for i in keep], [remap[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                                [values[i] for i in keep])


@dataclass
class _Calibration:
    """A source's running accepted / predicted node ratio (started at 1 with ``prior`` pseudo-counts)."""

    accepted: float
    predicted: float

    @property
    def ratio(self) -> float:
        return self.accepted / self.predicted


@dataclass
class HybridState:
    copy: Any
    model: Any
    calibration: tuple[_Calibration, _Calibration]
    gain: float = 0.0  # running accepted tokens only the drafter proposed, per step it ran (weighted sum)
    runs: float = 0.0  # the running count those are divided by
    model_ran: bool = False
    tree: DraftTree = field(default_factory=DraftTree.empty)  # the last proposal
    sources: list[tuple[float | None, float | None]] = field(default_factory=list)  # per node of ``tree``: each
    # source's uncalibrated value (None: not proposed by it)
    model_steps: int = 0  # proposals in which the drafter ran
    steps: int = 0
    backoff: Backoff = field(default_factory=Backoff)  # when a resting drafter is probed
    paid: bool = True  # whether the drafter paid by the estimate its last run was decided on
    marginal: tuple[float, float, float, float] = (1.0, 1.0, 0.0, 0.0)  # (copy tokens, copy cost, extra cost,
    # copy's first value) of the last step: what its run is judged by once its tokens are known


class HybridDrafter(Drafter):
    """One verification tree per step from a copy tree and ``model``'s tree (see the module docstring).

    cost: this machine's verify costs T(1, m), by which the drafter rests while it does not pay; None: it
        runs every step.
    model_seconds: the drafter's measured proposal cost.
    """

    name = "hybrid"

    def __init__(self, model: Drafter, copy: CopyDrafter | None = None, config: HybridConfig = HybridConfig(), *,
                 cost: CostSurface | None = None, model_seconds: float = 0.0):
        self.model, self.copy, self.config = model, copy or CopyDrafter(), config
        self.name = f"hybrid({model.name})"
        self.hidden_layers = model.hidden_layers
        self.max_nodes = config.max_nodes
        self.cost, self.model_seconds = cost, model_seconds

    @classmethod
    def from_spec(cls, argument: str, target, options) -> "HybridDrafter":
        """``hybrid:SPEC``: copying merged with the drafter SPEC (made with the same options), this machine's
        costs (:func:`hybrid_for`)."""
        from selfdraft.inference.specs import make_drafter

        inner = make_drafter(argument, target, tree=options.tree, prompt_lookup=options.prompt_lookup or PromptLookupConfig())
        if isinstance(inner, (HybridDrafter, CopyDrafter)) or inner.max_nodes <= 0:
            raise SelfdraftError(f"hybrid:SPEC needs a drafter to merge with copying (a drafter folder or "
                                 f"draft-model:SPEC), got {argument!r}")
        return hybrid_for(target, inner, options.hybrid or HybridConfig())

    def start(self, prompt_ids, prefill):
        prior = self.config.prior
        return HybridState(self.copy.start(prompt_ids, prefill), self.model.start(prompt_ids, prefill),
                           (_Calibration(prior, prior), _Calibration(prior, prior)))

    def _judge(self, state: HybridState) -> tuple[bool, bool]:
        """(does running the drafter raise the step's rate, is it far from that) by ``state.marginal`` and the
        drafter's running gain: it adds about (1 - c) * g tokens for its cost D and the verification of its
        nodes; the copy tree alone emits 1 + its values' sum for T(its nodes + 1). Worth it when the added
        tokens are a larger share of the step's tokens than the added cost is of the step's cost; far from it
        below half the tokens it would need."""
        copy_tokens, copy_cost, extra_cost, copy_first = state.marginal
        gain = (1.0 - copy_first) * state.gain / state.runs
        need = copy_tokens * extra_cost / copy_cost  # the tokens that would pay for the extra cost
        return pays((copy_tokens + gain) / copy_tokens, copy_cost + extra_cost, copy_cost), gain < 0.5 * need

    def _runs_model(self, state: HybridState, copy_values: list[float], copy_first: float) -> bool:
        """Does the drafter run this step? Always at first and without costs; then while it pays, and on the
        back-off rule's probes while it does not."""
        if self.cost is None:
            return True
        n = min(len(copy_values), self.config.max_nodes)
        copy_cost = self.cost(1, n + 1)
        extra_cost = self.model_seconds + self.cost(1, min(n + self.model.max_nodes, self.config.max_nodes) + 1) - copy_cost
        state.marginal = (1.0 + sum(sorted(copy_values, reverse=True)[:n]), copy_cost, extra_cost, copy_first)
        if state.runs == 0:
            state.paid = True
            return True
        state.paid = self._judge(state)[0]
        return state.paid or state.backoff.probe()

    def propose(self, state: HybridState, sequence):
        copy_tree, state.copy = self.copy.propose(state.copy, sequence)
        r_copy, r_model = (c.ratio for c in state.calibration)
        copy_values = [min(1.0, r_copy * v) for v in copy_tree.values or ()]
        copy_first = max((v for v, p in zip(copy_values, copy_tree.parent_ids) if p < 0), default=0.0)
        state.model_ran = self._runs_model(state, copy_values, copy_first)
        model_tree = DraftTree.empty()
        if state.model_ran:
            model_tree, state.model = self.model.propose(state.model, sequence)
            state.model_steps += 1
        state.steps += 1
        model_raw = list(model_tree.values) if model_tree.values is not None else [1.0] * model_tree.num_nodes

        # Merge the two trees as a trie: node -> (token, parent, raw value per source).
        tokens: list[int] = []
        parents: list[int] = []
        raw: list[list[float | None]] = []
        index: dict[tuple[int, int], int] = {}
        for source, tree, values in ((COPY, copy_tree, copy_tree.values or ()), (MODEL, model_tree, model_raw)):
            mapped: list[int] = []
            for tok, p, v in zip(tree.token_ids, tree.parent_ids, values):
                parent = mapped[p] if p >= 0 else -1
                node = index.get((parent, tok))
                if node is None:
                    node = index[(parent, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(parent)
                    raw.append([None, None])
                raw[node][source] = v
                mapped.append(node)
        values = []
        for i, p in enumerate(parents):  # parents first; a path is accepted no more often than its prefix
            v = max(min(1.0, r * x) for r, x in zip((r_copy, r_model), raw[i]) if x is not None)
            values.append(v if p < 0 else min(v, values[p]))
        kept = best_nodes(parents, values, self.config.max_nodes)
        tree = valued_tree(tokens, parents, values, self.config.max_nodes, keep=kept)
        state.tree = tree
        state.sources = [tuple(raw[i]) for i in kept]
        return tree, state

    def step_seconds(self, state: HybridState) -> float:
        """The drafter's measured cost on the steps it ran, nothing on the others (copying costs well
        under a millisecond)."""
        return self.model_seconds if state.model_ran else 0.0

    def observe(self, state: HybridState, verified: Verified):
        state.copy = self.copy.observe(state.copy, verified)
        state.model = self.model.observe(state.model, verified)
        tree, accepted = state.tree, verified.tokens[:-1]
        if tree.num_nodes == 0 and not state.model_ran:  # nothing proposed, or a plain step of the policy
            return state
        children: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(tree.token_ids, tree.parent_ids))}
        sources = state.sources
        if verified.tree is not None and verified.tree.num_nodes < tree.num_nodes:  # the policy cut the proposal
            mine: list[int] = []  # the proposal's node of each verified node (parents come first)
            for tok, p in zip(verified.tree.token_ids, verified.tree.parent_ids):
                mine.append(children[(mine[p] if p >= 0 else -1, tok)])
            kept = set(mine)
            sources = [state.sources[i] if i in kept else (None, None) for i in range(tree.num_nodes)]
        hits = [0, 0]
        model_only = 0  # accepted nodes copying did not propose: what the drafter added
        node = -1
        for tok in accepted:
            node = children.get((node, tok), None)
            if node is None:  # the step verified a tree the drafter did not propose (cannot happen in our decoder)
                break
            for s in (COPY, MODEL):
                hits[s] += sources[node][s] is not None
            model_only += sources[node][COPY] is None
        m = self.config.memory
        for s, cal in enumerate(state.calibration):
            predicted = sum(src[s] for src in sources if src[s] is not None)
            if predicted > 0:
                cal.accepted = m * cal.accepted + hits[s]
                cal.predicted = m * cal.predicted + predicted
        if state.model_ran:
            state.gain = m * state.gain + model_only
            state.runs = m * state.runs + 1
            if state.runs > 0 and self.cost is not None:  # judge the run by what it brought
                pays_now, far = self._judge(state)
                state.backoff.learn(state.paid, pays_now, far and not pays_now)
        state.tree, state.sources, state.model_ran = DraftTree.empty(), [], False
        return state


def hybrid_for(target, model: Drafter, config: HybridConfig = HybridConfig(), copy: CopyConfig = CopyConfig()) -> HybridDrafter:
    """The hybrid of ``model`` and copy drafting for ``target``, with this machine's cost curve and
    ``model``'s measured proposal cost (both cached: see inference/costs.py)."""
    cost = verify_cost(target, max(COST_TOKENS, config.max_nodes + 1))
    return HybridDrafter(model, CopyDrafter(copy), config, cost=cost, model_seconds=draft_cost(target, model))
