"""Verification of a draft tree against the target's logits: pure functions, no model.

Both rules walk the tree from the root (tree position 0) and return the accepted draft positions
plus one token chosen by the target (the "bonus" token), so every step emits at least one token.

- Greedy: follow the child whose token is the target's argmax; stop where none matches and emit the
  argmax there. The output is the target's own greedy output, token for token.
- Sampling (lossless for deterministic children): at a node with target distribution p, set r = p;
  for each child c in order accept with probability r(c) / sum(r); on rejection set r(c) = 0 and try
  the next child; if none is accepted, sample the bonus from r / sum(r). Whatever the drafter's
  children are, as long as they do not depend on this step's random draws, the emitted token is
  distributed exactly as p: the walk is sampling x ~ p while checking the children one by one.
  (min(1, p/q) with the draft's softmax is only valid for children sampled i.i.d. from q; the tests
  show that it is biased here.)

Devices: the logits and probabilities stay on the target's device and the random generator lives
there too; the tree is host-side (tree.py). Each rule reads what it decides on back to the host in
one or two batched copies per step, not one per node.

Shape letters: M tree positions, V vocabulary, P paths, L path length, I inner (non-leaf) positions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from selfdraft.configs.decode import DecodeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.inference.tree import TreeBuffers


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target's sampling distribution, as transformers' logits warpers define it.

    logits: (M, V). Returns (M, V) float64 probabilities after temperature, then top-k (ties with
    the k-th value kept), then top-p (the most likely tokens whose cumulative mass reaches top_p,
    at least one).
    """
    if temperature <= 0:
        raise SelfdraftError(f"target_probs needs temperature > 0, got {temperature!r}: greedy decoding takes the argmax "
                             "of the logits (greedy_verify, choose_token with temperature 0) instead")
    scores = logits.double() / temperature
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (M, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1] = False  # keep at least the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def _host_ids(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """Draft token ids as a list of ints (a tree's ``token_ids``, or a CPU tensor read once)."""
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


def _child_index(tokens: list[int], buffers: TreeBuffers, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) parent position and (N,) token of every draft node, on ``device``, in one host-to-device copy."""
    both = torch.tensor([list(buffers.parents[1:]), tokens], dtype=torch.long, device=device)  # (2, N)
    return both[0], both[1]


def _longest_path(ok: list[bool], buffers: TreeBuffers) -> tuple[int, ...]:
    """The root-first path whose draft positions are acceptable (``ok[i]``, i >= 1) for longest from the
    root, up to its last acceptable position; the first path on ties."""
    best: tuple[int, ...] = (0,)
    for path in buffers.paths:
        n = 1
        while n < len(path) and ok[path[n]]:
            n += 1
        if n > len(best):
            best = path[:n]
    return best


def greedy_verify(logits: torch.Tensor, tokens: Sequence[int] | torch.Tensor, buffers: TreeBuffers) -> tuple[list[int], int]:
    """Longest path whose tokens equal the target's argmax, plus the argmax after it.

    logits: (M, V) target logits at the tree positions, on any device; tokens: (N,) draft token ids
    (host), N = M - 1. One device-to-host copy: the (M,) argmax.
    Returns (accepted tree positions in path order, without the root; bonus token id).
    """
    argmax = logits.argmax(dim=-1).tolist()  # (M,)
    tokens = _host_ids(tokens)
    ok = [False] + [tokens[i - 1] == argmax[buffers.parents[i]] for i in range(1, buffers.size)]
    path = _longest_path(ok, buffers)
    return list(path[1:]), argmax[path[-1]]


def sample_verify(
    probs: torch.Tensor, tokens: Sequence[int] | torch.Tensor, buffers: TreeBuffers, generator: torch.Generator
) -> tuple[list[int], int]:
    """Lossless sampling verification for deterministic children (module docstring).

    probs: (M, V) float64 target distributions at the tree positions (from :func:`target_probs`), on
    any device; ``generator`` lives on the same device. tokens: (N,) draft token ids (host).
    Returns (accepted tree positions, bonus token id).

    The walk runs on the host from one copy of what it reads: each child's mass r(c) under its parent,
    the mass of each node's distribution outside its children (a masked sum, exactly 0 when the
    children hold all of it) and one uniform draw per child (each child is tried at most once, so each
    decision still has its own independent draw). The sum of the residual is the outside mass plus the
    masses of the children not rejected yet. Then one draw for the bonus token, on the device.
    """
    tokens = _host_ids(tokens)
    device, n = probs.device, buffers.size - 1
    node = 0
    accepted: list[int] = []
    zeroed: list[int] = []
    if n:
        parent, token = _child_index(tokens, buffers, device)
        inner = [i for i in range(buffers.size) if buffers.children[i]]
        # Each inner node's child tokens, padded with its first child's (zeroing a token twice is harmless).
        width = max(len(buffers.children[i]) for i in inner)
        pad = [[tokens[c - 1] for c in buffers.children[i]] + [tokens[buffers.children[i][0] - 1]] * (width - len(buffers.children[i]))
               for i in inner]
        rows_and_pad = torch.tensor([[i] + row for i, row in zip(inner, pad)], dtype=torch.long, device=device)  # (I, 1 + width)
        outside = probs[rows_and_pad[:, 0]].scatter(1, rows_and_pad[:, 1:], 0.0).sum(dim=1)  # (I,)
        uniform = torch.rand(n, dtype=torch.float64, device=device, generator=generator)  # (N,)
        host = torch.cat([probs[parent, token], uniform, outside]).tolist()  # the walk's one copy
        mass, draw, rest = host[:n], host[n : 2 * n], dict(zip(inner, host[2 * n :]))
        while buffers.children[node]:
            kids = buffers.children[node]
            remaining = {tokens[c - 1]: mass[c - 1] for c in kids}  # distinct child tokens -> r(token)
            chosen = -1
            for child in kids:
                tok = tokens[child - 1]
                if tok not in remaining:
                    continue  # a duplicate of a rejected sibling: r(tok) is already 0
                if mass[child - 1] > 0.0:
                    total = rest[node] + sum(remaining.values())
                    if draw[child - 1] * total < mass[child - 1] or mass[child - 1] >= total:
                        chosen = child
                        break
                del remaining[tok]
                zeroed.append(tok)
            if chosen < 0:
                break
            accepted.append(chosen)
            node = chosen
            zeroed = []
    residual = probs[node]
    if zeroed:
        residual = residual.index_fill(0, torch.tensor(zeroed, dtype=torch.long, device=device), 0.0)
    return accepted, torch.multinomial(residual, 1, generator=generator).item()


def typical_verify(
    probs: torch.Tensor, tokens: Sequence[int] | torch.Tensor, buffers: TreeBuffers, generator: torch.Generator,
    epsilon: float, delta: float,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance: LOSSY, the output no longer follows the target's distribution.

    A draft token x below a node with target distribution p is plausible when
    p(x) > min(epsilon, delta * exp(-H(p))). Takes the longest path of plausible tokens (first path
    on ties) and samples the bonus token from p at its end. probs: (M, V) float64 on the generator's
    device; tokens: (N,) draft token ids (host). Two device-to-host copies.
    """
    path: tuple[int, ...] = (0,)
    if buffers.size > 1:
        entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)  # (M,)
        threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))  # (M,)
        parent, token = _child_index(_host_ids(tokens), buffers, probs.device)
        ok = [False] + (probs[parent, token] > threshold[parent]).tolist()  # (M,)
        path = _longest_path(ok, buffers)
    bonus = torch.multinomial(probs[path[-1]], 1, generator=generator).item()
    return list(path[1:]), bonus


def choose_token(logits: torch.Tensor, config: DecodeConfig, generator: torch.Generator | None) -> int:
    """One token from a single row of logits (V,): the argmax, or a sample from the target's distribution
    (``generator`` on the logits' device)."""
    if config.greedy:
        return logits.argmax().item()
    probs = target_probs(logits[None], config.temperature, config.top_k, config.top_p)[0]
    return torch.multinomial(probs, 1, generator=generator).item()
