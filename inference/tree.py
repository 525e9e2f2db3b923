"""Draft trees and their verification buffers: pure functions, no model.

A draft tree hangs below a *root*: the last committed token, whose key/values are not in the target's
cache yet. One verification forward feeds the root and all N draft nodes, M = N + 1 positions, in
"tree order": position 0 is the root, position i (1..N) is draft node i-1. A node is always after
its parent, so the buffers below are plain lower-triangular structures.

Devices. A tree's shape is host-side structure: the decoder walks it in Python (which child to try,
which path was accepted), so :class:`DraftTree` and :class:`TreeBuffers` hold CPU tensors and Python
tuples, made with ``device="cpu"`` explicitly. What a forward needs (token ids, positions, the 4D
mask) is put on the model's device by the session, in one copy each per step
(heads/target_layers.py builds the masks there). :func:`grow_dynamic_tree` works on the drafter's
device and brings the finished tree to the host in one copy; :func:`grow_dynamic_trees` grows the trees
of a batch of rows in lockstep (one drafter forward per depth for all of them), in one copy too.

Shape letters (docs/architecture.md): B batch rows, N draft nodes, M = N + 1 tree positions, P paths, L path
length, V' draft vocabulary, S tree slots fed so far, W committed cache columns, F and C a depth's and
all depths' candidates.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from functools import cached_property
from typing import Callable, Sequence

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.target_layers import additive_mask  # noqa: F401  (re-exported: the drafters' masks)

HOST = torch.device("cpu")


class DraftTreeError(SelfdraftError, ValueError):
    """A malformed draft tree, from a drafter (one's own, through the Python API). A ValueError too,
    for callers that check values that way."""


@dataclass(frozen=True)
class DraftTree:
    """A token tree proposed by a drafter (host-side: both tensors on the CPU).

    tokens:  (N,) int64, the draft token at each node.
    parents: (N,) int64, index of each node's parent among the nodes, -1 for a child of the root;
             parents[i] < i.
    Siblings should carry distinct tokens (a duplicate can never be accepted; it only costs compute).
    ``token_ids`` / ``parent_ids`` are the same as tuples of ints (read from the tensors once, or
    given as ``host``).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    host: InitVar[tuple[Sequence[int], Sequence[int]] | None] = None
    """The same tokens and parents as sequences of ints, when the caller has them (saves reading the
    tensors back); :meth:`from_lists` passes them."""
    values: tuple[float, ...] | None = None
    """Optional, per node: the drafter's estimate of the probability that the target accepts the path
    to it, which the drafting policy's value cut (inference/policy.py) ranks nodes by."""

    def __post_init__(self, host):
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise DraftTreeError(f"a draft tree's tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} "
                                 "must be 1-D tensors of one length (N,): the drafter built a bad tree; build it with "
                                 "DraftTree.from_lists(tokens, parents)")
        if self.tokens.device != HOST or self.parents.device != HOST:
            raise DraftTreeError(f"a DraftTree is host-side structure: tokens ({self.tokens.device}) and parents "
                                 f"({self.parents.device}) must be CPU tensors; build it with DraftTree.from_lists")
        if host is not None:  # cached_property values live in the instance dict
            self.__dict__.update(token_ids=tuple(host[0]), parent_ids=tuple(host[1]))
        if self.values is not None and (len(self.values) != self.num_nodes or not all(0.0 <= v <= 1.0 for v in self.values)):
            raise DraftTreeError(f"a draft tree's values must be one probability in [0, 1] per node ({self.num_nodes}), got "
                                 f"{list(self.values)}: the drafter built a bad tree")
        if any(not -1 <= p < i for i, p in enumerate(self.parent_ids)):
            raise DraftTreeError(f"a draft tree's parents must satisfy -1 <= parents[i] < i (a node after its parent, "
                                 f"-1 for a child of the root), got {list(self.parent_ids)}: the drafter built a bad tree")

    @cached_property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokens.tolist())

    @cached_property
    def parent_ids(self) -> tuple[int, ...]:
        return tuple(self.parents.tolist())

    @classmethod
    def from_lists(cls, tokens: Sequence[int], parents: Sequence[int], values: Sequence[float] | None = None) -> "DraftTree":
        """A tree from host sequences of ints (tokens and parents as in the class docstring), and
        optionally each node's value."""
        tokens, parents = tuple(int(t) for t in tokens), tuple(int(p) for p in parents)
        return cls(torch.tensor(tokens, dtype=torch.long, device=HOST), torch.tensor(parents, dtype=torch.long, device=HOST),
                   (tokens, parents), None if values is None else tuple(float(v) for v in values))

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls.from_lists((), ())

    @classmethod
    def chain(cls, tokens: Sequence[int], values: Sequence[float] | None = None) -> "DraftTree":
        """A single path: each token is the child of the previous one."""
        return cls.from_lists(tokens, range(-1, len(tokens) - 1), values)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "DraftTree":
        """Merge token paths (each starting below the root) into a trie; shared prefixes share nodes.

        Nodes are numbered in breadth-first order, so the result does not depend on path order
        beyond the order of siblings (first seen first).
        """
        children: dict[tuple[int, ...], list[int]] = {(): []}
        for path in paths:
            prefix: tuple[int, ...] = ()
            for tok in path:
                tok = int(tok)
                kids = children[prefix]
                if tok not in kids:
                    kids.append(tok)
                prefix = prefix + (tok,)
                children.setdefault(prefix, [])
        tokens: list[int] = []
        parents: list[int] = []
        frontier: list[tuple[tuple[int, ...], int]] = [((), -1)]
        while frontier:
            next_frontier = []
            for prefix, node in frontier:
                for tok in children[prefix]:
                    tokens.append(tok)
                    parents.append(node)
                    next_frontier.append((prefix + (tok,), len(tokens) - 1))
            frontier = next_frontier
        return cls.from_lists(tokens, parents)

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    def depths(self) -> list[int]:
        """Depth of each node (N); children of the root have depth 1."""
        depth: list[int] = []
        for p in self.parent_ids:
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def prune(self, max_depth: int, max_nodes: int) -> "DraftTree":
        """Drop nodes deeper than ``max_depth``, then keep the first ``max_nodes`` (ancestors come first,
        so the result is still a tree)."""
        n = self.num_nodes
        if n == 0 or max_depth <= 0 or max_nodes <= 0:
            return DraftTree.empty()
        # A node deeper than max_depth has only deeper descendants, so dropping by depth keeps trees.
        idx = [i for i, d in enumerate(self.depths()) if d <= max_depth][:max_nodes]
        if len(idx) == n:
            return self
        return self.subtree(idx)

    def best_path(self) -> "DraftTree":
        """The tree cut to one root-to-leaf chain (for targets that verify chains only): from the root,
        the child of highest value at each depth where nodes carry values, else the first child."""
        if self.num_nodes == 0:
            return self
        parents, values = self.parent_ids, self.values
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)
        keep, node = [], -1
        while node in children:
            kids = children[node]
            node = kids[0] if values is None else max(kids, key=lambda i: float(values[i]))
            keep.append(node)
        return self if len(keep) == self.num_nodes else self.subtree(keep)

    def subtree(self, keep: Sequence[int]) -> "DraftTree":
        """The nodes ``keep`` (ascending indices, each node's parent kept with it), renumbered, values kept."""
        remap = {old: new for new, old in enumerate(keep)}
        parents = self.parent_ids
        if any(parents[i] >= 0 and parents[i] not in remap for i in keep):
            raise DraftTreeError(f"subtree {list(keep)} drops a parent of a kept node: not a tree")
        return DraftTree.from_lists([self.token_ids[i] for i in keep], [remap[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                                    None if self.values is None else [self.values[i] for i in keep])


@dataclass(frozen=True)
class TreeBuffers:
    """Everything a verification step needs about the tree's shape (not its tokens), on the host.

    parents:   (M,) parent position of each tree position (-1 for the root).
    depths:    (M,) depth of each tree position; the root is 0. Position ids are past + depth.
    children:  M tuples of child positions, in node order (the order sampling verification tries them).
    paths:     P root-to-leaf paths as tree positions, root first (leaves in position order).
    ancestors: (M, M) bool CPU tensor, ancestors[i, j] is True when position j is i itself or an
               ancestor of i: the attention pattern of the tree part of the mask.
    is_chain:  the tree is a single path (plain causal attention suffices).
    """

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    paths: tuple[tuple[int, ...], ...]
    ancestors: torch.Tensor
    is_chain: bool

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)


def build_tree_buffers(tree: DraftTree) -> TreeBuffers:
    """Turn a draft tree (N nodes) into the buffers of its M = N + 1 tree positions."""
    # Tree position of each node's parent: node i sits at position i + 1, the root at 0.
    parents = (-1,) + tuple(p + 1 for p in tree.parent_ids)
    m = len(parents)
    depths = [0] * m
    children: list[list[int]] = [[] for _ in range(m)]
    lineage: list[tuple[int, ...]] = [(0,)]  # lineage[i]: the root-first path to position i
    for i in range(1, m):
        p = parents[i]
        depths[i] = depths[p] + 1
        children[p].append(i)
        lineage.append(lineage[p] + (i,))
    rows = [i for i in range(m) for _ in lineage[i]]
    cols = [j for i in range(m) for j in lineage[i]]
    ancestors = torch.zeros(m, m, dtype=torch.bool, device=HOST)
    ancestors[rows, cols] = True
    return TreeBuffers(
        parents=parents,
        depths=tuple(depths),
        children=tuple(tuple(c) for c in children),
        paths=tuple(lineage[i] for i in range(m) if not children[i]),
        ancestors=ancestors,
        is_chain=all(parents[i] == i - 1 for i in range(1, m)),
    )


ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grow_dynamic_tree(root_log_probs: torch.Tensor, expand: ExpandFn, *, depth: int, top_k: int, max_nodes: int,
                      past: int, to_target: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DraftTree:
    """EAGLE-2's dynamic tree, grown on the device of ``root_log_probs``; one copy to the host at the end.

    Depth 1 takes the ``top_k`` best children of the root. At each further depth the ``top_k`` candidates
    of the previous depth with the best cumulative draft log-probability are expanded together: ``expand``
    feeds them to the drafter (one forward, tree attention over its cache) and returns their children's
    log-probabilities; each proposes its ``top_k`` best children. Finally the ``max_nodes`` best
    candidates overall form the tree, ordered by depth, then score (a child never scores above its
    parent and ties go to the shallower node, so the set is closed under ancestors). Each node's value
    (``DraftTree.values``) is its cumulative draft probability.

    root_log_probs: (V',) the drafter's log-probabilities below the root.
    expand(tokens, rows, positions, visible) -> (m, V'): feed m nodes: tokens (m,) target ids;
        rows (m,) for each node the row of the *previous* ``expand`` output that predicted it (its
        parent; for depth-1 nodes row 0, the root's prediction); positions (m,) = past - 1 + the node's
        depth; visible (m, past + S + m) bool: which cached entries each node may attend to (all ``past``
        committed ones, the S tree slots its ancestors were fed at, itself). The drafter's cache grows by
        m entries per call: the caller crops them afterwards.
    to_target: draft-vocabulary ids -> target ids (EAGLE-3's reduced vocabulary), or None.
    Candidates are laid out by depth; those of one depth are (m, top_k) row-major, so candidate j of a
    depth was proposed by row j // top_k of that depth's ``expand`` output.

    One row of :func:`grow_dynamic_trees`, run by the same code without the batch dimension.
    """
    device = root_log_probs.device
    host = _grow(root_log_probs, expand, depth=depth, top_k=top_k, max_nodes=max_nodes,
                 past=torch.full((), past, dtype=torch.long, device=device),
                 cached=torch.ones(past, dtype=torch.bool, device=device), to_target=to_target)
    return DraftTree.from_lists([int(t) for t in host[0]], [int(p) for p in host[1]], host[2])


def grow_dynamic_trees(root_log_probs: torch.Tensor, expand: ExpandFn, *, depth: int, top_k: int, max_nodes: int,
                       past: torch.Tensor, cached: torch.Tensor,
                       to_target: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[DraftTree]:
    """:func:`grow_dynamic_tree` for B rows in lockstep: one ``expand`` per depth feeds every row's
    ``top_k`` chosen nodes together (one drafter forward for the batch), and each row's tree is the one
    it grows alone (the choices are per row; only the shapes are shared: every row feeds ``top_k`` nodes
    per depth, so tree slot s is the same cache column in every row). One copy to the host at the end.

    root_log_probs: (B, V') each row's log-probabilities below its root.
    past: (B,) long, each row's committed positions: its depth-d nodes are fed at position past - 1 + d.
    cached: (B, W) bool, the W committed cache columns each row's nodes may attend to (a batch cache
        padded to its longest row holds other rows' padding, which stays hidden).
    expand(tokens, rows, positions, visible) -> (B, m, V'): feed m nodes per row: tokens (B, m) target
        ids; rows (B, m) for each node the row (within its batch row) of the previous ``expand`` output
        that predicted it (0 at depth 1: the root's prediction); positions (B, m); visible
        (B, m, W + S + m) bool: ``cached``, the S tree slots of the node's ancestors, itself. The cache
        grows by m columns per call: the caller drops them afterwards.
    to_target: draft-vocabulary ids -> target ids (EAGLE-3's reduced vocabulary), or None.
    Returns the B trees, in row order.
    """
    host = _grow(root_log_probs, expand, depth=depth, top_k=top_k, max_nodes=max_nodes, past=past, cached=cached,
                 to_target=to_target)
    return [DraftTree.from_lists([int(t) for t in tokens], [int(p) for p in parents], values)
            for tokens, parents, values in zip(*host)]


def _grow(root_log_probs: torch.Tensor, expand: ExpandFn, *, depth: int, top_k: int, max_nodes: int, past: torch.Tensor,
          cached: torch.Tensor, to_target: Callable[[torch.Tensor], torch.Tensor] | None) -> list:
    """The tree growth of :func:`grow_dynamic_trees` over any leading batch shape ``lead`` (``()`` for
    :func:`grow_dynamic_tree`'s one row, ``(B,)`` for a batch): root_log_probs (*lead, V'), past lead,
    cached (*lead, W); every index runs along the last dimensions. Returns the host lists (3, *lead, N):
    tokens, parents and values of the kept nodes."""
    lead, device = root_log_probs.shape[:-1], root_log_probs.device
    top = torch.topk(root_log_probs, top_k, dim=-1)  # (*lead, k)
    ids = top.indices
    tokens = [ids if to_target is None else to_target(ids)]  # per depth: (*lead, F) target ids of the candidates
    scores = [top.values]  # per depth: (*lead, F) cumulative log-probabilities
    parents = [torch.full((*lead, top_k), -1, dtype=torch.long, device=device)]  # per depth: (*lead, F) parent candidate
    seen = torch.zeros(*lead, top_k, 0, dtype=torch.bool, device=device)  # (*lead, F, S): tree slots of its ancestors
    offset = 0  # candidate index of the first candidate of the previous depth
    # Every depth expands k nodes (depth 1 has k candidates, each later one k * k): the parts of each
    # depth's mask and positions that do not depend on the choice are made once.
    itself = torch.eye(top_k, dtype=torch.bool, device=device).expand(*lead, top_k, top_k)  # (*lead, k, k)
    committed = cached.unsqueeze(-2).expand(*lead, top_k, cached.shape[-1])  # (*lead, k, W)
    first = past.unsqueeze(-1).expand(*lead, top_k)  # (*lead, k): position of a depth-1 node
    for d in range(2, depth + 1):
        frontier = scores[-1]  # (*lead, F)
        chosen = torch.sort(frontier, dim=-1, descending=True, stable=True).indices[..., :top_k]  # (*lead, k) best first, ties by index
        ancestors = seen.gather(-2, chosen.unsqueeze(-1).expand(*lead, top_k, seen.shape[-1]))  # (*lead, k, S)
        slots = torch.cat([ancestors, itself], dim=-1)  # (*lead, k, S + k)
        visible = torch.cat([committed, slots], dim=-1)  # (*lead, k, W + S + k)
        log_probs = expand(tokens[-1].gather(-1, chosen), chosen // top_k, first + (d - 2), visible)  # (*lead, k, V')
        child = torch.topk(log_probs, top_k, dim=-1)  # (*lead, k, k)
        ids = child.indices.flatten(-2)  # (*lead, k * k) row-major: node r's children are r*k .. r*k + k - 1
        tokens.append(ids if to_target is None else to_target(ids))
        scores.append((frontier.gather(-1, chosen).unsqueeze(-1) + child.values).flatten(-2))
        parents.append((offset + chosen).unsqueeze(-1).expand(*lead, top_k, top_k).flatten(-2))
        seen = slots.unsqueeze(-2).expand(*lead, top_k, top_k, slots.shape[-1]).flatten(-3, -2)  # (*lead, k * k, S + k)
        offset += frontier.shape[-1]
    all_scores = torch.cat(scores, dim=-1)  # (*lead, C) candidates in depth order
    all_depths = torch.cat([torch.full((s.shape[-1],), i + 1, dtype=torch.long, device=device) for i, s in enumerate(scores)])
    keep = torch.sort(all_scores, dim=-1, descending=True, stable=True).indices[..., :max_nodes]  # (*lead, N) best first; ties: shallower
    keep = keep.gather(-1, torch.sort(all_depths[keep], dim=-1, stable=True).indices)  # parents first: by depth, then score
    remap = keep.new_full(all_scores.shape, -1)  # (*lead, C): candidate -> its node index, -1 if dropped
    remap.scatter_(-1, keep, torch.arange(keep.shape[-1], device=device).expand_as(keep))
    kept_parents = torch.cat(parents, dim=-1).gather(-1, keep)  # (*lead, N)
    kept_parents = torch.where(kept_parents >= 0, remap.gather(-1, kept_parents.clamp(min=0)), kept_parents)
    probs = all_scores.gather(-1, keep).double().exp().clamp(max=1.0)  # each node's cumulative draft probability
    return torch.stack([torch.cat(tokens, dim=-1).gather(-1, keep).double(), kept_parents.double(), probs]).tolist()  # the one copy
