"""The decoding loop: draft, verify in one target forward, compact the cache, emit, repeat.

The same loop runs every drafter; with :class:`~selfdraft.inference.drafters.NoDrafter` it is the
vanilla one-token-per-forward baseline. It talks to the target through a
:class:`~selfdraft.inference.session.TargetSession` (a transformers model in practice, a scripted
stub in the statistical tests).

Devices: logits, probabilities and the sampler's random generator stay on the target's device (the
generator is made on the logits' device and seeded from ``DecodeConfig.seed``, so runs on one device
are reproducible); the tree and the emitted tokens are host-side. Per step the host reads the device
a few times, each a batched copy: the drafter's proposal (one per draft depth at most), the
verification (one or two), nothing per node. tests/test_decode_devices.py counts them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from selfdraft.configs.decode import DecodeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.inference.drafters import Drafter, Verified
from selfdraft.inference.policy import FIXED, DraftPolicy
from selfdraft.inference.session import TargetSession
from selfdraft.inference.tree import DraftTree, build_tree_buffers
from selfdraft.inference.verify import choose_token, greedy_verify, sample_verify, target_probs, typical_verify

SampleRule = Callable[[torch.Tensor, Sequence[int], object, torch.Generator], tuple[list[int], int]]
"""(probs (M, V), draft token ids (N,), TreeBuffers, generator) -> (accepted positions, bonus token)."""


@dataclass
class DecodeStats:
    """Acceptance statistics of one generation.

    accept_histogram[k]: target forwards that emitted k tokens (the prefill emits 1).
    depth_drafted[d] / depth_accepted[d] (d = 1, 2, ...): verification steps whose tree reached
    depth d / that accepted a draft token at depth d.
    """

    target_forwards: int = 0
    accept_histogram: Counter = field(default_factory=Counter)
    depth_drafted: Counter = field(default_factory=Counter)
    depth_accepted: Counter = field(default_factory=Counter)
    draft_nodes: int = 0
    """Draft nodes verified (after the drafting policy's cut, if any)."""
    proposed_nodes: int = 0
    """Draft nodes the drafter proposed (before the cut)."""
    draft_seconds: float = 0.0
    drafted_steps: int = 0
    """Verification steps that ran the drafter (the adaptive policy's probes included)."""
    skipped_steps: int = 0
    """Plain steps the drafting policy chose because drafting did not pay."""

    def count_step(self, tree: DraftTree, buffers, accepted: Sequence[int], new: Sequence[int]) -> None:
        """Count one verification step: ``tree`` verified, ``accepted`` of its positions kept, ``new`` emitted."""
        self.accept_histogram[len(new)] += 1
        self.draft_nodes += tree.num_nodes
        for d in range(1, buffers.max_depth + 1):
            self.depth_drafted[d] += 1
            self.depth_accepted[d] += d <= len(accepted)

    def depth_acceptance(self) -> dict[int, float]:
        """Per depth d: the share of steps that drafted depth d and accepted a token there."""
        return {d: self.depth_accepted[d] / n for d, n in sorted(self.depth_drafted.items())}


@dataclass
class DecodeOutput:
    token_ids: list[int]
    stats: DecodeStats
    seconds: float
    stop_reason: str  # "eos", "max_new_tokens" or "context"


def speculative_decode(
    session: TargetSession,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    config: DecodeConfig,
    *,
    eos_token_ids: Sequence[int] = (),
    max_context: int | None = None,
    sample_rule: SampleRule = sample_verify,
    policy: DraftPolicy = FIXED,
) -> DecodeOutput:
    """Generate up to ``config.max_new_tokens`` tokens after ``prompt_ids``.

    Greedy (temperature 0) output equals the target's own greedy decoding; sampled output has the
    target's distribution (after temperature / top-k / top-p). ``sample_rule`` exists so the tests
    can plant a biased rule and show that they detect it. ``policy`` decides whether a step drafts and
    what part of the tree it verifies (inference/policy.py; default: the whole tree every step); exact
    whichever it is.
    """
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise SelfdraftError("the prompt is empty: give at least one token")
    if max_context is not None and len(prompt_ids) > max_context:
        raise SelfdraftError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context holds {max_context}; "
            "shorten the prompt or use a model with a longer context"
        )
    eos = set(int(t) for t in eos_token_ids) if config.stop_on_eos else set()
    stats = DecodeStats()
    start = time.perf_counter()

    out = session.prefill(prompt_ids)
    stats.target_forwards = 1
    generator = sampling_generator(config, out.logits.device, config.seed)
    first = choose_token(out.logits[-1].float(), config, generator)
    emitted = [first]
    stats.accept_histogram[1] += 1
    sequence = prompt_ids + emitted
    t0 = time.perf_counter()
    state = drafter.start(prompt_ids, out)
    stats.draft_seconds += time.perf_counter() - t0
    stop_reason = "eos" if first in eos else "max_new_tokens"
    run = policy.run(1)

    while first not in eos and len(emitted) < config.max_new_tokens:
        if max_context is not None and session.length >= max_context:  # no position left for the root
            stop_reason = "context"
            break
        remaining = config.max_new_tokens - len(emitted)
        budget = run.plan((0,), (remaining,))
        drafting = budget != 0
        if drafting:
            t0 = time.perf_counter()
            tree, state = drafter.propose(state, sequence)
            stats.draft_seconds += time.perf_counter() - t0
            stats.drafted_steps += 1
        else:  # a plain step; the drafter catches up on it at its next proposal
            tree = DraftTree.empty()
            stats.skipped_steps += 1
        stats.proposed_nodes += tree.num_nodes
        # Deeper nodes could never be emitted (budget) or would not fit the context.
        max_depth = remaining - 1
        if max_context is not None:
            max_depth = min(max_depth, max_context - 1 - session.length)
        tree = tree.prune(max_depth=max_depth, max_nodes=tree.num_nodes if budget is None else budget)
        step_seconds = drafter.step_seconds(state) if drafting else None
        if drafting:  # what is worth verifying of what can still be emitted
            [tree] = run.verify([tree], [step_seconds])
        if not session.trees:  # a recurrent target verifies one chain (heads/target_layers.py)
            tree = tree.best_path()
        buffers = tree_buffers(tree)

        out = session.verify(sequence[-1], tree, buffers)
        stats.target_forwards += 1
        accepted, bonus = accept(out.logits, tree, buffers, config, generator, sample_rule)
        keep = [0] + accepted
        session.commit(keep)
        if drafting:
            run.record((0,), [tree], [len(keep)], [step_seconds])

        new, hit_eos = committed_tokens(tree, accepted, bonus, eos, remaining)
        if hit_eos:
            stop_reason = "eos"
        emitted += new
        sequence += new
        stats.count_step(tree, buffers, accepted, new)

        if stop_reason == "eos":
            break
        t0 = time.perf_counter()
        state = drafter.observe(state, verified(out, keep, new, tree))
        stats.draft_seconds += time.perf_counter() - t0

    return DecodeOutput(token_ids=emitted, stats=stats, seconds=time.perf_counter() - start, stop_reason=stop_reason)


_EMPTY_BUFFERS = build_tree_buffers(DraftTree.empty())


def tree_buffers(tree: DraftTree):
    """The tree's verification buffers (one shared object for the empty tree of a plain step)."""
    return _EMPTY_BUFFERS if tree.num_nodes == 0 else build_tree_buffers(tree)


def sampling_generator(config: DecodeConfig, device, seed: int | None) -> torch.Generator | None:
    """The random generator a sampled decode draws from, on the target's device (it samples there): seeded
    with ``seed``, or freshly without touching torch's global generator; None when decoding greedily."""
    if config.greedy:
        return None
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def accept(logits: torch.Tensor, tree: DraftTree, buffers, config: DecodeConfig, generator: torch.Generator | None,
           sample_rule: SampleRule = sample_verify) -> tuple[list[int], int]:
    """One verification: (accepted tree positions, bonus token) of the target's ``logits`` (M, V) over the
    tree, by the greedy rule, Medusa's typical acceptance (LOSSY) or ``sample_rule``."""
    if config.greedy:
        return greedy_verify(logits, tree.token_ids, buffers)
    probs = target_probs(logits, config.temperature, config.top_k, config.top_p)
    if config.lossy:
        return typical_verify(probs, tree.token_ids, buffers, generator, config.typical_epsilon, config.typical_delta)
    return sample_rule(probs, tree.token_ids, buffers, generator)


def committed_tokens(tree: DraftTree, accepted: Sequence[int], bonus: int, eos: set[int],
                     remaining: int) -> tuple[list[int], bool]:
    """The tokens a step emits (the accepted drafts, then the bonus), cut after the first EOS token and to
    ``remaining``; and whether an EOS token was emitted."""
    new = [tree.token_ids[i - 1] for i in accepted] + [bonus]
    for i, tok in enumerate(new):
        if tok in eos:
            return new[: i + 1][:remaining], True
    return new[:remaining], False


def verified(out, keep: Sequence[int], new: list[int], tree: DraftTree | None = None) -> Verified:
    """What the drafter observes after a step: the emitted tokens, the target's hidden states at the root
    and the accepted positions ``keep`` (gathered on the target's device), and the tree verified."""
    hidden = ()
    if out.hidden:
        index = torch.tensor(list(keep), dtype=torch.long, device=out.hidden[0].device)
        hidden = tuple(h.index_select(0, index) for h in out.hidden)
    return Verified(tokens=new, hidden=hidden, tree=tree)
