"""Adaptive drafting: per request, draft only while drafting buys tokens faster than plain decoding,
and look again now and then once it stops paying.

A drafted step costs the drafter's proposal D plus one target forward over the root and the n nodes
verified, T(n + 1), and emits 1 + (accepted drafts) tokens; a plain step costs T(1) and emits one.
Both costs come from this machine's measured costs (inference/costs.py: T(1, m), batch 1's row)
and the drafter's measured proposal time (or, for a drafter whose cost varies from step to step, such as
a hybrid that skips its drafter, the modelled cost it reports), never from a clock read during decoding: the decisions then
depend only on what the target accepted, so a seeded sampled run is reproducible.

:class:`Throttle` keeps running means (exponentially weighted, over about the last 20 drafted steps) of
tokens emitted and cost per drafted step. While their ratio is at least (1 - slack) / T(1) the request
drafts (the slack keeps a drafter that costs next to nothing, such as prompt lookup, on through the
steps where it finds nothing); when it is not, the request decodes plain steps and drafts once more
after ``first_wait`` of them (a probe, which verifies only the draft tokens that cost at most 15% more
than a plain step here). After a probe that does not pay, the wait doubles, up to
``longest_wait``, where the drafter brings less than half the extra tokens it would need (a drafter
that never accepts then costs one probe in every ``longest_wait`` steps); a drafter close to paying is
probed again after ``first_wait``.

Exactness: whether a step drafts is decided before the target sees that step, from earlier steps
only, so each step is a verification of a tree the drafter could have proposed (or of none): greedy
output stays token-identical to the target's, sampled output lossless. Skipping the drafter is safe
for every drafter: :meth:`~selfdraft.inference.drafters.Drafter.observe` still sees every committed
token, and the next :meth:`~selfdraft.inference.drafters.Drafter.propose` catches up on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from selfdraft.errors import SelfdraftError
from selfdraft.inference.costs import COST_TOKENS, CostSurface, draft_cost, pays, verify_cost

ADAPTIVE = ("on", "off")


@dataclass(frozen=True)
class Throttle:
    """When a request drafts: the costs it weighs and how it probes (one per drafter, shared by requests;
    each request keeps its own :class:`ThrottleState`)."""

    cost: CostSurface
    """T(1, m): batch 1's verify costs."""
    draft_seconds: float
    memory: float = 0.95
    """Weight of the past in the running means: the newest drafted step weighs max(1 - memory, 1 / n) at
    the n-th drafted step (a plain mean while there are few)."""
    slack: float = 0.03
    """Drafting goes on while it loses at most this share of plain decoding's rate (a cheap drafter that
    sometimes proposes nothing is not switched off for its tiny cost)."""
    min_drafted: int = 8
    """Drafted steps a request takes before it may switch drafting off."""
    first_wait: int = 4
    """Plain steps before the first probe once drafting stopped paying."""
    longest_wait: int = 64
    """The most plain steps between two probes."""
    learnt: "Learnt" = field(default_factory=lambda: Learnt(), compare=False, repr=False)
    """What the requests decoded with this throttle so far learnt: the next request starts from it."""

    def __post_init__(self):
        if not 0.0 <= self.slack < 1.0:
            raise SelfdraftError(f"slack must be in [0, 1), got {self.slack}")
        if not 0.0 <= self.memory < 1.0:
            raise SelfdraftError(f"memory must be in [0, 1), got {self.memory}")
        if self.draft_seconds < 0:
            raise SelfdraftError(f"draft_seconds must be >= 0, got {self.draft_seconds}")
        if not 1 <= self.first_wait <= self.longest_wait:
            raise SelfdraftError(f"need 1 <= first_wait <= longest_wait, got {self.first_wait} and {self.longest_wait}")
        if self.min_drafted < 1:
            raise SelfdraftError(f"min_drafted must be >= 1, got {self.min_drafted}")

    def start(self) -> "ThrottleState":
        return ThrottleState(self)

    @cached_property
    def probe_nodes(self) -> int:
        """The draft nodes a probe verifies: those that cost at most 15% more than a plain step on the cost
        curve (at least one), so probing a drafter that does not pay costs little where verifying more
        tokens costs more."""
        return cheap_nodes(self.cost)

    def step_cost(self, nodes: int) -> float:
        """Modelled seconds of a drafted step that verified ``nodes`` draft nodes."""
        return self.cost(1, nodes + 1) + self.draft_seconds


def cheap_nodes(cost: CostSurface, batch: int = 1, most: int = 64) -> int:
    """The draft nodes per row (at least one, at most ``most``) whose verification at ``batch`` rows costs at
    most 15% more than a plain step: what a probe verifies."""
    n = 1
    while n < most and cost(batch, n + 2) <= 1.15 * cost(batch, 1):
        n += 1
    return n


@dataclass
class Learnt:
    """Running means over every drafted step of the requests a throttle has seen (same weights as a
    request's own), so that a request does not spend its first steps relearning a drafter that did not
    pay on the requests before it."""

    tokens: float = 0.0
    seconds: float = 0.0
    drafted: int = 0
    interval: int = 0
    """The wait between probes the last hopeless probe set (reset by a step that paid or came close)."""


class ThrottleState:
    """One request's running estimate of what drafting buys, and its decisions.

    The first request of a throttle drafts its first ``min_drafted`` steps. A later one starts from what
    the earlier ones learnt: drafting while that pays, else plain steps and a first probe after half the
    wait the last hopeless probe set (at least ``2 * first_wait``: a new prompt may suit the drafter
    better than the last ones did), so a drafter that never accepts costs about one probe per
    ``longest_wait`` steps across requests, not a fresh series of short waits in each."""

    def __init__(self, throttle: Throttle):
        self.throttle = throttle
        self.tokens = 0.0  # running mean of tokens emitted per drafted step
        self.seconds = 0.0  # running mean of modelled seconds per drafted step
        self.drafted = 0  # drafted steps so far (probes included)
        self.skipped = 0  # plain steps the throttle chose
        self.probes = 0
        self.wait = 0  # plain steps left before the next probe
        self.interval = throttle.first_wait
        self.probing = False  # whether the step just decided is a probe
        learnt = throttle.learnt
        if learnt.drafted >= throttle.min_drafted:
            self.tokens, self.seconds, self.drafted = learnt.tokens, learnt.seconds, throttle.min_drafted
            if not self.pays():
                self.wait = self.interval = min(max(2 * throttle.first_wait, learnt.interval // 2), throttle.longest_wait)

    def pays(self) -> bool:
        """Do drafted steps emit tokens faster than plain ones, by the running means?"""
        return pays(self.tokens, self.seconds, self.throttle.cost(1, 1), self.throttle.slack)

    def should_draft(self) -> bool:
        """Does the next step draft? (Decided before the target sees it.) A probe sets ``probing``."""
        self.probing = False
        if self.drafted < self.throttle.min_drafted or self.pays():
            return True
        if self.wait > 0:
            self.wait -= 1
            self.skipped += 1
            return False
        self.probes += 1
        self.probing = True
        return True

    def probe_nodes(self) -> int | None:
        """The most draft nodes the current step verifies: :attr:`Throttle.probe_nodes` on a probe, None
        on other steps."""
        return self.throttle.probe_nodes if self.probing else None

    def record(self, nodes: int, emitted: int, draft_seconds: float | None = None) -> None:
        """A drafted step verified ``nodes`` draft nodes and emitted ``emitted`` tokens (accepted + 1);
        ``draft_seconds``: its proposal's modelled cost where the drafter gives one (else the measured constant)."""
        t = self.throttle
        paid_before = self.drafted < t.min_drafted or self.pays()  # what should_draft saw
        seconds = t.step_cost(nodes) if draft_seconds is None else t.cost(1, nodes + 1) + draft_seconds
        self.drafted += 1
        w = max(1.0 - t.memory, 1.0 / self.drafted)
        self.tokens += w * (emitted - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        learnt = t.learnt
        learnt.drafted += 1
        w = max(1.0 - t.memory, 1.0 / learnt.drafted)
        learnt.tokens += w * (emitted - learnt.tokens)
        learnt.seconds += w * (seconds - learnt.seconds)
        if self.drafted < t.min_drafted or self.pays():
            self.interval = learnt.interval = t.first_wait
        elif paid_before:  # it just stopped paying: plain steps, then a first probe
            self.interval = self.wait = t.first_wait
        elif self.hopeless():  # a probe of a drafter far from paying: wait twice as long before the next
            self.interval = learnt.interval = min(2 * self.interval, t.longest_wait)
            self.wait = self.interval
        else:  # close to paying: probe again soon
            self.interval = self.wait = learnt.interval = t.first_wait

    def hopeless(self) -> bool:
        """Do drafted steps bring less than half the extra tokens they would need to pay?"""
        need = (1.0 - self.throttle.slack) * self.seconds / self.throttle.cost(1, 1)
        return self.tokens - 1.0 < 0.5 * (need - 1.0)


def throttle_for(target, drafter, mode: str = "on", *, max_nodes: int | None = None) -> Throttle | None:
    """The throttle a decode with ``drafter`` uses: ``on`` (the default) for any drafter that proposes
    something, with this machine's cost curve up to the drafter's largest tree (``max_nodes``, else
    :attr:`~selfdraft.inference.drafters.Drafter.max_nodes`) and its measured proposal time; None for
    ``off`` or the no-drafter baseline."""
    if mode not in ADAPTIVE:
        raise SelfdraftError(f"unknown adaptive mode {mode!r}; choose one of {', '.join(ADAPTIVE)}")
    nodes = drafter.max_nodes if max_nodes is None else max_nodes
    if mode == "off" or nodes <= 0:
        return None
    return Throttle(verify_cost(target, max(COST_TOKENS, nodes + 1)), draft_cost(target, drafter))
