"""Draft trees and their verification buffers: pure tensor functions, no model.

A draft tree hangs below a *root*: the last committed token, whose key/values are not in the target's
cache yet. One verification forward feeds the root and all N draft nodes, M = N + 1 positions, in
"tree order": position 0 is the root, position i (1..N) is draft node i-1. A node is always after
its parent, so the buffers below are plain lower-triangular structures.

Shape letters (DESIGN.md): N draft nodes, M = N + 1 tree positions, P paths, L path length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class DraftTree:
    """A token tree proposed by a drafter.

    tokens:  (N,) int64, the draft token at each node.
    parents: (N,) int64, index of each node's parent among the nodes, -1 for a child of the root;
             parents[i] < i.
    Siblings should carry distinct tokens (a duplicate can never be accepted; it only costs compute).
    """

    tokens: torch.Tensor
    parents: torch.Tensor

    def __post_init__(self):
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError(f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} must be equal 1-D shapes")
        n = self.tokens.numel()
        if n and not bool((self.parents < torch.arange(n)).all() and (self.parents >= -1).all()):
            raise ValueError(f"parents must satisfy -1 <= parents[i] < i, got {self.parents.tolist()}")

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "DraftTree":
        """A single path: each token is the child of the previous one."""
        n = len(tokens)
        return cls(torch.tensor(list(tokens), dtype=torch.long), torch.arange(-1, n - 1, dtype=torch.long))

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
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    def depths(self) -> torch.Tensor:
        """(N,) depth of each node; children of the root have depth 1."""
        parents = self.parents.tolist()
        depth = [0] * len(parents)
        for i, p in enumerate(parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return torch.tensor(depth, dtype=torch.long)

    def prune(self, max_depth: int, max_nodes: int) -> "DraftTree":
        """Drop nodes deeper than ``max_depth``, then keep the first ``max_nodes`` (ancestors come first,
        so the result is still a tree)."""
        n = self.num_nodes
        if n == 0 or max_depth <= 0 or max_nodes <= 0:
            return DraftTree.empty()
        keep = self.depths() <= max_depth
        if bool(keep.all()) and n <= max_nodes:
            return self
        # A node deeper than max_depth has only deeper descendants, so dropping by depth keeps trees.
        idx = torch.nonzero(keep).flatten()[:max_nodes]
        remap = torch.full((n,), -1, dtype=torch.long)
        remap[idx] = torch.arange(idx.numel())
        parents = self.parents[idx]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        return DraftTree(self.tokens[idx], parents)


@dataclass(frozen=True)
class TreeBuffers:
    """Everything a verification step needs about the tree's shape (not its tokens).

    depth:     (M,) int64, depth of each tree position; the root is 0. Position ids are past + depth.
    ancestors: (M, M) bool, ancestors[i, j] is True when position j is i itself or an ancestor of i:
               the attention pattern of the tree part of the mask.
    paths:     (P, L) int64, the root-to-leaf paths as tree positions, padded with -1; paths[:, 0] = 0.
    parent:    (M,) int64, parent position of each position (-1 for the root).
    children:  M lists of child positions, in node order (the order sampling verification tries them).
    is_chain:  the tree is a single path (plain causal attention suffices).
    """

    depth: torch.Tensor
    ancestors: torch.Tensor
    paths: torch.Tensor
    parent: torch.Tensor
    children: tuple[tuple[int, ...], ...]
    is_chain: bool

    @property
    def size(self) -> int:
        return self.depth.numel()


def build_tree_buffers(tree: DraftTree) -> TreeBuffers:
    """Turn a draft tree (N nodes) into the buffers of its M = N + 1 tree positions."""
    n = tree.num_nodes
    m = n + 1
    # Tree position of each node's parent: node i sits at position i + 1, the root at 0.
    parent = torch.cat([torch.tensor([-1]), tree.parents + 1])  # (M,)
    parent_list = parent.tolist()
    depth = [0] * m
    children: list[list[int]] = [[] for _ in range(m)]
    ancestors = torch.zeros(m, m, dtype=torch.bool)
    ancestors[0, 0] = True
    for i in range(1, m):
        p = parent_list[i]
        depth[i] = depth[p] + 1
        children[p].append(i)
        ancestors[i] = ancestors[p]
        ancestors[i, i] = True
    leaves = [i for i in range(m) if not children[i]]
    max_len = max(depth) + 1
    paths = torch.full((len(leaves), max_len), -1, dtype=torch.long)  # (P, L)
    for row, leaf in enumerate(leaves):
        chain = torch.nonzero(ancestors[leaf]).flatten()  # ancestors have smaller indices: root first
        paths[row, : chain.numel()] = chain
    is_chain = all(parent_list[i] == i - 1 for i in range(1, m))
    return TreeBuffers(
        depth=torch.tensor(depth, dtype=torch.long),
        ancestors=ancestors,
        paths=paths,
        parent=parent,
        children=tuple(tuple(c) for c in children),
        is_chain=is_chain,
    )


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(Q, K) bool "may attend" -> (1, 1, Q, K) additive mask of ``dtype``: 0 where allowed, the
    dtype's most negative value elsewhere. A float mask, never a bool one: the eager attention path
    adds the mask (FACTS.md)."""
    mask = torch.zeros(1, 1, *visible.shape, dtype=dtype)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


def tree_attention_mask(ancestors: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4D mask for feeding M tree positions after ``past`` cached tokens.

    ancestors: (M, M) bool from :class:`TreeBuffers`. Returns (1, 1, M, past + M): every cached token
    and the position's own ancestors are visible.
    """
    m = ancestors.shape[0]
    visible = torch.cat([torch.ones(m, past, dtype=torch.bool), ancestors], dim=1)  # (M, past + M)
    return additive_mask(visible, dtype)
