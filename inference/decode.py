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
from selfdraft.inference.adaptive import Throttle
from selfdraft.inference.drafters import Drafter, Verified
from selfdraft.inference.schedule import VerifySchedule
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
    """Draft nodes verified (after the schedule's cut, if any)."""
    proposed_nodes: int = 0
    """Draft nodes the drafter proposed (before the schedule's cut)."""
    draft_seconds: float = 0.0
    drafted_steps: int = 0
    """Verification steps that ran the drafter (the adaptive throttle's probes included)."""
    skipped_steps: int = 0
    """Plain steps the adaptive throttle chose because drafting did not pay."""

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
    schedule: VerifySchedule | None = None,
    throttle: Throttle | None = None,
) -> DecodeOutput:
    """Generate up to ``config.max_new_tokens`` tokens after ``prompt_ids``.

    Greedy (temperature 0) output equals the target's own greedy decoding; sampled output has the
    target's distribution (after temperature / top-k / top-p). ``sample_rule`` exists so the tests
    can plant a biased rule and show that they detect it. With a ``schedule``, each tree that carries
    node values is cut to the part worth verifying (inference/schedule.py); with a ``throttle``, a step
    drafts only while drafting pays for this request (inference/adaptive.py); exact all the same.
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
    generator = None
    if not config.greedy:  # it samples on the target's device, so it lives there
        generator = torch.Generator(device=out.logits.device)
        if config.seed is None:
            generator.seed()  # a fresh non-deterministic seed, without touching torch's global generator
        else:
            generator.manual_seed(config.seed)
    first = choose_token(out.logits[-1].float(), config, generator)
    emitted = [first]
    stats.accept_histogram[1] += 1
    sequence = prompt_ids + emitted
    t0 = time.perf_counter()
    state = drafter.start(prompt_ids, out)
    stats.draft_seconds += time.perf_counter() - t0
    stop_reason = "eos" if first in eos else "max_new_tokens"
    gate = throttle.start() if throttle is not None else None

    while first not in eos and len(emitted) < config.max_new_tokens:
        if max_context is not None and session.length >= max_context:  # no position left for the root
            stop_reason = "context"
            break
        remaining = config.max_new_tokens - len(emitted)
        drafting = gate is None or gate.should_draft()
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
        probe = gate.probe_nodes() if gate is not None and drafting else None  # a probe verifies a cheap part
        tree = tree.prune(max_depth=max_depth, max_nodes=tree.num_nodes if probe is None else probe)
        if schedule is not None:  # what is worth verifying of what can still be emitted
            tree = schedule.cut(tree)
        buffers = tree_buffers(tree)

        out = session.verify(sequence[-1], tree, buffers)
        stats.target_forwards += 1
        if config.greedy:
            accepted, bonus = greedy_verify(out.logits, tree.token_ids, buffers)
        else:
            probs = target_probs(out.logits, config.temperature, config.top_k, config.top_p)
            if config.lossy:
                accepted, bonus = typical_verify(probs, tree.token_ids, buffers, generator,
                                                 config.typical_epsilon, config.typical_delta)
            else:
                accepted, bonus = sample_rule(probs, tree.token_ids, buffers, generator)
        keep = [0] + accepted
        session.commit(keep)
        if gate is not None and drafting:
            gate.record(tree.num_nodes, len(keep), drafter.step_seconds(state))

        new = [tree.token_ids[i - 1] for i in accepted] + [bonus]
        for i, tok in enumerate(new):
            if tok in eos:
                new = new[: i + 1]
                stop_reason = "eos"
                break
        new = new[:remaining]
        emitted += new
        sequence += new
        stats.accept_histogram[len(new)] += 1
        stats.draft_nodes += tree.num_nodes
        for d in range(1, buffers.max_depth + 1):
            stats.depth_drafted[d] += 1
            stats.depth_accepted[d] += d <= len(accepted)

        if stop_reason == "eos":
            break
        t0 = time.perf_counter()
        hidden = ()
        if out.hidden:  # the root and the accepted positions, gathered on the target's device
            index = torch.tensor(keep, dtype=torch.long, device=out.hidden[0].device)
            hidden = tuple(h.index_select(0, index) for h in out.hidden)
        state = drafter.observe(state, Verified(tokens=new, hidden=hidden))
        stats.draft_seconds += time.perf_counter() - t0

    return DecodeOutput(token_ids=emitted, stats=stats, seconds=time.perf_counter() - start, stop_reason=stop_reason)


_EMPTY_BUFFERS = build_tree_buffers(DraftTree.empty())


def tree_buffers(tree: DraftTree):
    """The tree's verification buffers (one shared object for the empty tree of a plain step)."""
    return _EMPTY_BUFFERS if tree.num_nodes == 0 else build_tree_buffers(tree)
