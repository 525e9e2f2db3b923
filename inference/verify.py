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

Shape letters: M tree positions, V vocabulary, P paths, L path length.
"""

from __future__ import annotations

import torch

from selfdraft.configs.decode import DecodeConfig
from selfdraft.inference.tree import TreeBuffers


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target's sampling distribution, as transformers' logits warpers define it.

    logits: (M, V). Returns (M, V) float64 probabilities after temperature, then top-k (ties with
    the k-th value kept), then top-p (the most likely tokens whose cumulative mass reaches top_p,
    at least one).
    """
    if temperature <= 0:
        raise ValueError("target_probs needs temperature > 0; greedy decoding uses the argmax")
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


def greedy_verify(logits: torch.Tensor, tokens: torch.Tensor, buffers: TreeBuffers) -> tuple[list[int], int]:
    """Longest path whose tokens equal the target's argmax, plus the argmax after it.

    logits: (M, V) target logits at the tree positions; tokens: (N,) draft tokens, N = M - 1.
    Returns (accepted tree positions in path order, without the root; bonus token id).
    """
    argmax = logits.argmax(dim=-1)  # (M,)
    if buffers.size == 1:
        return [], int(argmax[0])
    node_tokens = torch.cat([tokens.new_full((1,), -1), tokens])  # (M,) root carries no draft token
    match = node_tokens == argmax[buffers.parent.clamp(min=0)]  # (M,) position i agrees with its parent's argmax
    paths = buffers.paths  # (P, L)
    on_path = match[paths.clamp(min=0)] & (paths >= 0)  # (P, L)
    accepted_len = on_path[:, 1:].long().cumprod(dim=1).sum(dim=1)  # (P,)
    best = int(accepted_len.argmax())
    n_acc = int(accepted_len[best])
    path = paths[best].tolist()
    return path[1 : n_acc + 1], int(argmax[path[n_acc]])


def sample_verify(
    probs: torch.Tensor, tokens: torch.Tensor, buffers: TreeBuffers, generator: torch.Generator
) -> tuple[list[int], int]:
    """Lossless sampling verification for deterministic children (module docstring).

    probs: (M, V) float64 target distributions at the tree positions (from :func:`target_probs`);
    tokens: (N,) draft tokens. Returns (accepted tree positions, bonus token id).
    """
    token_at = tokens.tolist()
    accepted: list[int] = []
    node = 0
    while True:
        residual = probs[node]
        copied = False
        chosen = -1
        for child in buffers.children[node]:
            tok = token_at[child - 1]
            mass = float(residual[tok])
            if mass > 0.0:
                total = float(residual.sum()) if copied else 1.0
                if float(torch.rand((), dtype=torch.float64, generator=generator)) * total < mass:
                    chosen = child
                    break
            if not copied:
                residual = residual.clone()
                copied = True
            residual[tok] = 0.0
        if chosen < 0:
            bonus = int(torch.multinomial(residual, 1, generator=generator))
            return accepted, bonus
        accepted.append(chosen)
        node = chosen


def typical_verify(
    probs: torch.Tensor, tokens: torch.Tensor, buffers: TreeBuffers, generator: torch.Generator,
    epsilon: float, delta: float,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance: LOSSY, the output no longer follows the target's distribution.

    A draft token x below a node with target distribution p is plausible when
    p(x) > min(epsilon, delta * exp(-H(p))). Takes the longest path of plausible tokens (first path
    on ties) and samples the bonus token from p at its end. probs: (M, V) float64.
    """
    entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)  # (M,)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))  # (M,)
    if buffers.size > 1:
        parent = buffers.parent.clamp(min=0)  # (M,)
        node_tokens = torch.cat([tokens.new_zeros(1), tokens])  # (M,)
        ok = probs[parent, node_tokens] > threshold[parent]  # (M,)
        paths = buffers.paths  # (P, L)
        on_path = ok[paths.clamp(min=0)] & (paths >= 0)
        accepted_len = on_path[:, 1:].long().cumprod(dim=1).sum(dim=1)  # (P,)
        best = int(accepted_len.argmax())
        path = paths[best].tolist()[: int(accepted_len[best]) + 1]
    else:
        path = [0]
    bonus = int(torch.multinomial(probs[path[-1]], 1, generator=generator))
    return path[1:], bonus


def choose_token(logits: torch.Tensor, config: DecodeConfig, generator: torch.Generator | None) -> int:
    """One token from a single row of logits (V,): the argmax, or a sample from the target's distribution."""
    if config.greedy:
        return int(logits.argmax())
    probs = target_probs(logits[None], config.temperature, config.top_k, config.top_p)[0]
    return int(torch.multinomial(probs, 1, generator=generator))
