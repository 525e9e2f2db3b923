"""The decoding loop, one for every batch size: draft, verify in one target forward, compact the cache,
emit, repeat (:func:`batched_decode`; :func:`speculative_decode` is a batch of one).

The same loop runs every drafter; with :class:`~selfdraft.inference.drafters.NoDrafter` it is the
vanilla one-token-per-forward baseline. It talks to the target through a :class:`RowSession` (a
:class:`~selfdraft.inference.batch.BatchSession` in practice; a batch-1
:class:`~selfdraft.inference.session.TargetSession`, a scripted stub in the statistical tests, through
:class:`OneRow`).

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
from typing import Callable, Protocol, Sequence

import torch

from selfdraft.configs.decode import DecodeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.inference.drafters import Drafter, Verified
from selfdraft.inference.policy import FIXED, DraftPolicy
from selfdraft.inference.session import StepOutput, TargetSession
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
    session: TargetSession | RowSession,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    config: DecodeConfig,
    *,
    eos_token_ids: Sequence[int] = (),
    max_context: int | None = None,
    sample_rule: SampleRule = sample_verify,
    policy: DraftPolicy = FIXED,
) -> DecodeOutput:
    """Generate up to ``config.max_new_tokens`` tokens after ``prompt_ids``: :func:`batched_decode` of a
    batch of one (the one loop), seeded with ``config.seed``.

    Greedy (temperature 0) output equals the target's own greedy decoding; sampled output has the
    target's distribution (after temperature / top-k / top-p). ``session``: a
    :class:`~selfdraft.inference.batch.BatchSession` (what ``generate`` uses), or any batch-1
    :class:`~selfdraft.inference.session.TargetSession` (a scripted stub in the statistical tests), seen
    as a batch of one. ``sample_rule`` exists so the tests can plant a biased rule and show that they
    detect it. ``policy`` decides whether a step drafts and what part of the tree it verifies
    (inference/policy.py; default: the whole tree every step); exact whichever it is.
    """
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise SelfdraftError("the prompt is empty: give at least one token")
    if max_context is not None and len(prompt_ids) > max_context:
        raise SelfdraftError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context holds {max_context}; "
            "shorten the prompt or use a model with a longer context"
        )
    rows = session if hasattr(session, "lengths") else OneRow(session)
    [out] = batched_decode(rows, [prompt_ids], drafter, config, seeds=[config.seed], eos_token_ids=eos_token_ids,
                           max_context=max_context, policy=policy, sample_rule=sample_rule)
    return out


class RowSession(Protocol):
    """What the decoding loop needs from the target: a batch of rows, each with its own cache
    (:class:`~selfdraft.inference.batch.BatchSession`; a batch-1 session through :class:`OneRow`)."""

    lengths: list[int]
    """Per row: committed tokens, which is also the position id of its next token."""
    trees: bool
    """Whether branching trees can be verified in one forward (False: the loop sends chains only)."""

    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[StepOutput]: ...

    def verify(self, roots: Sequence[int], trees: Sequence[DraftTree], buffers: Sequence) -> list[StepOutput]: ...

    def commit(self, keeps: Sequence[Sequence[int]]) -> None: ...

    def select(self, rows: Sequence[int]) -> None: ...


class OneRow:
    """A batch-1 :class:`~selfdraft.inference.session.TargetSession` seen as a batch of one row."""

    def __init__(self, session: TargetSession):
        self.session = session

    @property
    def lengths(self) -> list[int]:
        return [self.session.length]

    @property
    def trees(self) -> bool:
        return self.session.trees

    def prefill(self, prompts):
        [prompt] = prompts
        return [self.session.prefill(prompt)]

    def verify(self, roots, trees, buffers):
        return [self.session.verify(roots[0], trees[0], buffers[0])]

    def commit(self, keeps) -> None:
        self.session.commit(keeps[0])

    def select(self, rows) -> None:
        if list(rows) != [0]:
            raise SelfdraftError(f"a batch of one keeps row 0, not {list(rows)}")


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


class _Row:
    """One prompt's decoding state inside a batch."""

    def __init__(self, index: int, prompt: list[int], seed: int | None):
        self.index = index  # its place in the batch as given
        self.prompt = prompt
        self.seed = seed
        self.sequence = list(prompt)
        self.emitted: list[int] = []
        self.stats = DecodeStats()
        self.generator: torch.Generator | None = None
        self.state = None
        self.stop_reason = "max_new_tokens"
        self.seconds = 0.0

    def start(self, out, drafter: Drafter, config: DecodeConfig, eos: set[int]) -> None:
        """The prefill's token, and the drafter's state for the prompt."""
        self.generator = sampling_generator(config, out.logits.device, self.seed)
        self.stats.target_forwards = 1
        first = choose_token(out.logits[-1].float(), config, self.generator)
        self.emitted.append(first)
        self.sequence.append(first)
        self.stats.accept_histogram[1] += 1
        t0 = time.perf_counter()
        self.state = drafter.start(self.prompt, out)
        self.stats.draft_seconds += time.perf_counter() - t0
        if first in eos:
            self.stop_reason = "eos"

    def fit(self, tree: DraftTree, budget: int | None, config: DecodeConfig, max_context: int | None,
            length: int) -> DraftTree:
        """The proposal cut to what can still be emitted, to the context left, and to the policy's budget."""
        self.stats.proposed_nodes += tree.num_nodes
        max_depth = config.max_new_tokens - len(self.emitted) - 1
        if max_context is not None:
            max_depth = min(max_depth, max_context - 1 - length)
        return tree.prune(max_depth=max_depth, max_nodes=tree.num_nodes if budget is None else min(budget, tree.num_nodes))

    def accept(self, out, tree: DraftTree, buffers, config: DecodeConfig, eos: set[int],
               sample_rule: SampleRule) -> tuple[list[int], list[int]]:
        """Verify the row's tree against the target's logits and emit: (the tree positions kept, root
        first; the tokens emitted)."""
        self.stats.target_forwards += 1
        accepted, bonus = accept(out.logits, tree, buffers, config, self.generator, sample_rule)
        new, hit_eos = committed_tokens(tree, accepted, bonus, eos, config.max_new_tokens - len(self.emitted))
        if hit_eos:
            self.stop_reason = "eos"
        self.emitted += new
        self.sequence += new
        self.stats.count_step(tree, buffers, accepted, new)
        return [0] + accepted, new


def batched_decode(
    session: RowSession,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter,
    config: DecodeConfig,
    *,
    seeds: Sequence[int | None] | None = None,
    eos_token_ids: Sequence[int] = (),
    max_context: int | None = None,
    policy: DraftPolicy = FIXED,
    sample_rule: SampleRule = sample_verify,
) -> list[DecodeOutput]:
    """Generate up to ``config.max_new_tokens`` tokens after each prompt, all rows in one target forward
    per step. Returns one :class:`DecodeOutput` per prompt, in order; a row's ``seconds`` is the time
    until it finished (its latency in the batch).

    Each row's greedy output equals its own batch-1 output; sampled rows keep the target's distribution,
    row by row. ``seeds``: one per prompt (default: ``config.seed`` for every row, so a row decodes as
    the same prompt alone with that seed would). ``policy``: whether the live rows draft and what part
    of each row's tree is verified, at the live batch size (inference/policy.py; default: every row's whole
    tree every step).
    """
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise SelfdraftError("the batch is empty: give at least one prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise SelfdraftError(f"prompt {i} of the batch is empty: give at least one token")
        if max_context is not None and len(p) > max_context:
            raise SelfdraftError(f"prompt {i} of the batch has {len(p)} tokens but the model's context holds "
                                 f"{max_context}; shorten it or use a model with a longer context")
    seeds = [config.seed] * len(prompts) if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise SelfdraftError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one per prompt")
    eos = set(int(t) for t in eos_token_ids) if config.stop_on_eos else set()
    start = time.perf_counter()

    rows = [_Row(i, prompt, seed) for i, (prompt, seed) in enumerate(zip(prompts, seeds))]
    for row, out in zip(rows, session.prefill(prompts)):
        row.start(out, drafter, config, eos)
    live = _finish(session, rows, config, max_context, start)
    run = policy.run(len(rows))
    while live:
        ids = [row.index for row in live]
        budget = run.plan(ids, [config.max_new_tokens - len(row.emitted) for row in live])
        trees = _proposals(drafter, live, drafting=budget != 0)
        trees = [row.fit(tree, budget, config, max_context, length) for row, tree, length in zip(live, trees, session.lengths)]
        step_seconds = [drafter.step_seconds(row.state) for row in live] if budget != 0 else []
        if budget != 0:  # what is worth verifying at this batch size
            trees = run.verify(trees, step_seconds)
        if not session.trees:  # a recurrent target verifies one chain per row
            trees = [tree.best_path() for tree in trees]
        buffers = [tree_buffers(tree) for tree in trees]
        outs = session.verify([row.sequence[-1] for row in live], trees, buffers)
        keeps = [row.accept(out, tree, b, config, eos, sample_rule) for row, out, tree, b in zip(live, outs, trees, buffers)]
        session.commit([keep for keep, _ in keeps])
        if budget != 0:
            run.record(ids, trees, [len(keep) for keep, _ in keeps], step_seconds)
        for row, (keep, new), out, tree in zip(live, keeps, outs, trees):
            if row.stop_reason != "eos":
                t0 = time.perf_counter()
                row.state = drafter.observe(row.state, verified(out, keep, new, tree))
                row.stats.draft_seconds += time.perf_counter() - t0
        live = _finish(session, live, config, max_context, start)

    return [DecodeOutput(token_ids=row.emitted, stats=row.stats, seconds=row.seconds, stop_reason=row.stop_reason)
            for row in rows]


def _proposals(drafter: Drafter, live: list[_Row], drafting: bool) -> list[DraftTree]:
    """Every live row's proposal (empty trees on a plain step, which the drafter catches up on at its next
    proposal): one call for the batch, so a batched drafter drafts every row in one forward; a batch of one
    proposes through ``propose``. The time is shared out among the rows."""
    if not drafting:
        for row in live:
            row.stats.skipped_steps += 1
        return [DraftTree.empty()] * len(live)
    t0 = time.perf_counter()
    proposals = ([drafter.propose(live[0].state, live[0].sequence)] if len(live) == 1 else
                 drafter.propose_batch([row.state for row in live], [row.sequence for row in live]))
    share = (time.perf_counter() - t0) / len(live)
    trees = []
    for row, (tree, row.state) in zip(live, proposals):
        row.stats.draft_seconds += share
        row.stats.drafted_steps += 1
        trees.append(tree)
    return trees


def _finish(session: RowSession, live: list[_Row], config: DecodeConfig, max_context: int | None,
            start: float) -> list[_Row]:
    """The rows that go on (in session order); finished ones get their time and leave the session."""
    going = []
    for i, row in enumerate(live):
        if row.stop_reason != "eos" and max_context is not None and session.lengths[i] >= max_context \
                and len(row.emitted) < config.max_new_tokens:
            row.stop_reason = "context"  # no position left for the root
        if row.stop_reason in ("eos", "context") or len(row.emitted) >= config.max_new_tokens:
            row.seconds = time.perf_counter() - start
        else:
            going.append(i)
    if going and len(going) < len(live):
        session.select(going)
    return [live[i] for i in going]
