"""How much to draft: one policy decides, step by step, whether the live rows draft and how many draft
nodes each row verifies, and learns from what each step committed.

The decode loop (inference/decode.py: B rows in one target forward, a single request a batch of one)
drives a :class:`PolicyRun` (one per request or batch, from :meth:`DraftPolicy.run`):

1. :meth:`PolicyRun.plan` before the drafter runs: 0 (a plain step; the drafter is not run), None (the
   drafter's whole tree) or n (at most n draft nodes per row);
2. :meth:`PolicyRun.verify` after it proposed: the part of each row's tree the target verifies;
3. :meth:`PolicyRun.record` after the target verified: what the step bought.

The policies (``selfdraft generate --policy``, ``policy=`` in the Python API; :data:`POLICIES`):

- ``fixed``: every step verifies the drafter's whole tree.
- ``cut``: every step drafts, and a tree whose nodes carry values (a block drafter's confidence, the
  copy drafter's frequencies) is cut to the part worth verifying at the live batch size
  (:func:`value_cut`).
- ``adaptive``: the cut, and drafting only while drafting pays (:class:`Adaptive`).
- ``profile``: as many drafts per row as the drafter folder's ``speculation_profile.json`` found to pay
  at the live batch size (inference/speculation.py plans it).
- ``auto`` (the default): ``profile`` for a batch of several prompts whose drafter folder carries a
  profile, ``adaptive`` otherwise.

The hybrid of copying and a drafter (inference/hybrid.py) rests its drafter part by the same
probe-and-back-off rule (:class:`Backoff`) and its merged tree is cut by :func:`value_cut`.

Costs: every decision reads this machine's measured costs (inference/costs.py: T(B, m) and the drafter's
proposal at B rows, D(B)) and what the target accepted, never a clock read during decoding, so a seeded
sampled run is reproducible.

Exactness: what a step verifies is decided before the target sees that step, from the drafter's state
and earlier steps only, so each step verifies a tree the drafter could have proposed (or none): greedy
output stays token-identical to the target's, sampled output lossless. A plain step is safe for every
drafter: it still observes every committed token and catches up at its next proposal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from selfdraft.configs.decode import POLICIES
from selfdraft.errors import SelfdraftError
from selfdraft.inference.costs import COST_TOKENS, CostSurface, pays, speedup
from selfdraft.inference.tree import DraftTree

logger = logging.getLogger(__name__)


class PolicyRun:
    """One request's or one batch's decisions (the base class is ``fixed``: the whole tree, every step)."""

    def plan(self, ids: Sequence[int], remaining: Sequence[int]) -> int | None:
        """Before the drafter runs, for the live rows (``ids``: their index in the batch; ``remaining``: the
        tokens each may still emit): 0 for a plain step, None for the whole tree, n for at most n nodes a row."""
        return None

    def verify(self, trees: list[DraftTree], draft_seconds: Sequence[float | None]) -> list[DraftTree]:
        """The part of each row's proposed tree the target verifies (``draft_seconds``: per row, the modelled
        cost of its proposal where its drafter gives one)."""
        return trees

    def record(self, ids: Sequence[int], trees: Sequence[DraftTree], emitted: Sequence[int],
               draft_seconds: Sequence[float | None]) -> None:
        """A drafted step verified ``trees`` and the i-th row emitted ``emitted[i]`` tokens (accepted + 1)."""


class DraftPolicy:
    """Makes one :class:`PolicyRun` per request or batch (and keeps what the runs learnt, where it learns)."""

    name = "fixed"

    def run(self, rows: int) -> PolicyRun:
        return PolicyRun()


FIXED = DraftPolicy()


def best_first(tree: DraftTree) -> tuple[list[int], list[float]]:
    """The tree's node indices by value, best first (values made non-increasing along paths, as a path is
    accepted no more often than its prefix; ties keep tree order, so every prefix is a tree)."""
    values = list(tree.values)
    for i, p in enumerate(tree.parent_ids):
        if p >= 0:
            values[i] = min(values[i], values[p])
    return sorted(range(len(values)), key=lambda i: (-values[i], i)), values


def value_cut(trees: list[DraftTree], cost: CostSurface, draft_seconds: float) -> list[DraftTree]:
    """Cut valued trees (one per live row) to the width with the most expected tokens per second.

    A node's value estimates the chance that the target accepts the path to it, so a row that verifies
    its w best nodes emits 1 + (their values' sum) tokens on average; a step of B rows verifying at most w
    nodes each costs T(B, w + 1) plus the step's proposals (``draft_seconds``, spent whatever is cut). The
    width w with the best rate over the plain step's wins (w = 0: nothing verified; ties keep the
    smaller w); each row keeps its best min(w, its nodes). At one row this is the confidence schedule of
    a single request. Trees without values are returned whole."""
    if not trees or any(t.values is None for t in trees) or all(t.num_nodes == 0 for t in trees):
        return trees
    rows = len(trees)
    ranked = [best_first(t) for t in trees]
    plain = cost(rows, 1)
    widest = max(t.num_nodes for t in trees)
    gains = [[0.0] for _ in trees]  # gains[r][w]: the values of row r's w best nodes
    for (order, values), g in zip(ranked, gains):
        for i in order:
            g.append(g[-1] + values[i])
    best_w, best_rate = 0, speedup(1.0, plain + draft_seconds, plain)
    for w in range(1, widest + 1):
        tokens = 1.0 + sum(g[min(w, len(g) - 1)] for g in gains) / rows
        rate = speedup(tokens, cost(rows, w + 1) + draft_seconds, plain)
        if rate > best_rate * (1 + 1e-9):
            best_w, best_rate = w, rate
    cut = []
    for tree, (order, _) in zip(trees, ranked):
        keep = min(best_w, tree.num_nodes)
        cut.append(tree if keep == tree.num_nodes else tree.subtree(sorted(order[:keep])))
    return cut


def cheap_nodes(cost: CostSurface, batch: int = 1, most: int = 64) -> int:
    """The draft nodes per row (at least one, at most ``most``) whose verification at ``batch`` rows costs at
    most 15% more than a plain step: what a learning step or a probe verifies."""
    n = 1
    while n < most and cost(batch, n + 2) <= 1.15 * cost(batch, 1):
        n += 1
    return n


class Backoff:
    """The probe-and-back-off rule: once drafting stops paying, plain steps, then a probe after
    ``first_wait`` of them; after a probe far from paying (``hopeless``) the wait doubles, up to
    ``longest_wait``; after one close to paying the next probe comes after ``first_wait`` again. Where a
    probe costs more than a plain step (``scale``: its cost beyond one, in plain steps), every wait is
    that many times longer, so that probing costs the same share of the time whatever the drafter."""

    def __init__(self, first_wait: int = 4, longest_wait: int = 64, interval: int | None = None, scale: float = 1.0):
        if not 1 <= first_wait <= longest_wait:
            raise SelfdraftError(f"need 1 <= first_wait <= longest_wait, got {first_wait} and {longest_wait}")
        self.first_wait, self.longest_wait, self.scale = first_wait, longest_wait, max(1.0, scale)
        self.interval = first_wait if interval is None else interval
        self.wait = 0 if interval is None else self._steps(interval)
        self.probes = 0

    def _steps(self, interval: int) -> int:
        """The plain steps of a wait: the interval, times what a probe costs in plain steps where that is more
        than one (a probe that costs six plain steps waits six times as long, so probing costs the same share)."""
        return round(interval * self.scale)

    def probe(self) -> bool:
        """A step while drafting does not pay: True for a probe, False for a plain step."""
        if self.wait > 0:
            self.wait -= 1
            return False
        self.probes += 1
        return True

    def learn(self, paid_before: bool, pays_now: bool, hopeless: bool) -> None:
        """After a drafted step: ``paid_before``, what the decision saw; ``pays_now``, after the step."""
        if pays_now:
            self.interval, self.wait = self.first_wait, 0
            return
        if paid_before or not hopeless:  # it just stopped paying, or came close: a probe soon
            self.interval = self.first_wait
        else:  # a probe far from paying: wait twice as long before the next
            self.interval = min(2 * self.interval, self.longest_wait)
        self.wait = self._steps(self.interval)


@dataclass
class Learnt:
    """Running means over every drafted step of the runs an :class:`Adaptive` policy has made, so that a
    request does not spend its first steps relearning a drafter that did not pay on the ones before it."""

    tokens: float = 0.0
    width: float = 0.0
    share: float = 0.0
    drafted: int = 0
    settled: bool = False
    """Whether a run finished learning (``min_drafted`` row-steps, or fewer that showed it cannot pay)."""
    interval: int = 0
    """The wait the last hopeless probe set (reset by a step that paid or came close)."""


class Adaptive(DraftPolicy):
    """Draft only while drafting pays at the live batch size; cut valued trees to what pays.

    A drafted step of B rows costs T(B, w + 1) (w: the widest row's verified nodes) plus the step's
    proposals D(B) (``draft_seconds``: rows -> seconds; a number is one proposal's, made row by row);
    a plain step costs T(B, 1). Running means (exponentially weighted, about the last 20 drafted steps:
    ``memory``) keep the tokens each row emits per drafted step E_i, the width, and the share of D(B) the
    steps spent (below 1 for a hybrid that rested its drafter). A batch whose rows do not refill lasts as
    long as its slowest row: with R_i tokens left to row i, drafting takes about max_i R_i / E_i steps where
    plain decoding takes max_i R_i, so the rows draft while (max_i R_i / E_i) (T(B, w + 1) + D(B)) (1 -
    ``slack``) < (max_i R_i) T(B, 1); at one row that is E T(1, 1) > (1 - slack) (T(1, w + 1) + D(1)). The
    slack keeps a drafter that costs next to nothing (prompt lookup finding no match) on.

    ``most_nodes`` (the drafter's largest tree; None: no bound, for a drafter whose proposals may cost less
    than ``draft_seconds``): at a batch size where even a step that had every draft accepted would not pay,
    the rows never draft (a row-by-row draft model in a batch on a CPU, say).

    A run learns for ``min_drafted`` row-steps (a step of B rows is B of them), or until one more step that
    accepted everything could not make its mean pay: a single request on whole trees (it learns its
    drafter's real acceptance), a batch on trees cut to :meth:`probe_nodes` (it pays for every row's tree);
    then it follows :class:`Backoff` once drafting stops paying, its probes cut to :meth:`probe_nodes`. A
    later run starts from what the earlier ones learnt (:class:`Learnt`): drafting while that pays, else
    plain steps and a first probe after half the wait the last hopeless probe set (at least ``2 *
    first_wait``: a new prompt may suit the drafter better), so a drafter that never accepts costs about
    one probe per ``longest_wait`` steps across requests."""

    name = "adaptive"

    def __init__(self, cost: CostSurface, draft_seconds: float | Callable[[int], float], *, gate: bool = True,
                 cut: bool = True, memory: float = 0.95, slack: float = 0.03, min_drafted: int = 8,
                 first_wait: int = 4, longest_wait: int = 64, most_nodes: int | None = None):
        if not 0.0 <= slack < 1.0:
            raise SelfdraftError(f"slack must be in [0, 1), got {slack}")
        if not 0.0 <= memory < 1.0:
            raise SelfdraftError(f"memory must be in [0, 1), got {memory}")
        if not callable(draft_seconds) and draft_seconds < 0:
            raise SelfdraftError(f"draft_seconds must be >= 0, got {draft_seconds}")
        if min_drafted < 1:
            raise SelfdraftError(f"min_drafted must be >= 1, got {min_drafted}")
        Backoff(first_wait, longest_wait)  # checks the waits
        self.cost = cost
        self.draft_seconds = draft_seconds if callable(draft_seconds) else (lambda rows, d=float(draft_seconds): rows * d)
        self.gate, self.cut = gate, cut
        self.memory, self.slack, self.min_drafted = memory, slack, min_drafted
        self.first_wait, self.longest_wait, self.most_nodes = first_wait, longest_wait, most_nodes
        self.learnt = Learnt()
        self.last: AdaptiveRun | None = None
        """The latest run (its own estimates; what every run learnt is in ``learnt``)."""
        self._probe: dict[int, int] = {}
        if not gate:
            self.name = "cut"

    def probe_nodes(self, rows: int) -> int:
        """The draft nodes per row a batch's learning steps and every probe verify at ``rows`` rows: the
        cheap ones (:func:`cheap_nodes`), or the fewest that could pay if every draft were accepted where
        those could not; 0 where no tree of at most ``most_nodes`` nodes could (the rows never draft)."""
        if rows not in self._probe:
            cheap = cheap_nodes(self.cost, rows)
            if self.most_nodes is not None:
                plain, spent = self.cost(rows, 1), self.draft_seconds(rows)
                fewest = next((k for k in range(1, self.most_nodes + 1)
                               if pays(k + 1.0, self.cost(rows, k + 1) + spent, plain, self.slack)), None)
                cheap = 0 if fewest is None else max(cheap, fewest)
            self._probe[rows] = cheap
        return self._probe[rows]

    def probe_cost(self, rows: int) -> float:
        """What a probe at ``rows`` rows costs beyond a plain step, in plain steps: its proposals and the
        verification of its nodes."""
        plain = self.cost(rows, 1)
        return (self.draft_seconds(rows) + self.cost(rows, max(self.probe_nodes(rows), 1) + 1) - plain) / plain

    def run(self, rows: int) -> "AdaptiveRun":
        self.last = AdaptiveRun(self, rows)
        return self.last


class AdaptiveRun(PolicyRun):
    """One request's or batch's running estimates and decisions under an :class:`Adaptive` policy."""

    def __init__(self, policy: Adaptive, rows: int):
        self.policy = p = policy
        self.tokens = self.width = 0.0  # running means: tokens a row emits, widest verified tree, per drafted step
        self.share = 1.0  # running mean of the share of D(B) a drafted step spent
        self.drafted = self.samples = 0  # drafted steps, drafted row-steps
        self.widest = 0  # the widest tree a step verified
        self.row_tokens: dict[int, float] = {}
        self.row_drafted: dict[int, int] = {}
        self.rows_left: list[tuple[int, int]] = []
        scale = p.probe_cost(rows)
        self.backoff = Backoff(p.first_wait, p.longest_wait, scale=scale)
        self.prior = 0  # the drafted steps a row's own mean starts from (the learnt mean's weight)
        self.learn_whole = rows == 1  # one request learns on whole trees; a batch on cheap ones
        learnt = p.learnt
        if learnt.settled:
            self.tokens, self.width, self.share = learnt.tokens, learnt.width, learnt.share
            self.drafted = self.samples = self.prior = p.min_drafted
            if not self.pays(rows):
                wait = min(max(2 * p.first_wait, learnt.interval // 2), p.longest_wait)
                self.backoff = Backoff(p.first_wait, p.longest_wait, interval=wait, scale=scale)

    def learning(self) -> bool:
        return self.samples < self.policy.min_drafted

    def _step(self, rows: int) -> tuple[float, float, float]:
        """(tokens per row of a drafted step, its seconds, a plain step's seconds) by the running means."""
        p = self.policy
        cost = p.cost(rows, self.width + 1) + self.share * p.draft_seconds(rows)
        tokens = self.tokens
        going = [(i, left) for i, left in self.rows_left if left > 0]
        if going:  # the batch lasts as long as its slowest row
            plain = max(left for _, left in going)
            drafted = max(left / max(self.row_tokens.get(i, self.tokens), 1.0) for i, left in going)
            tokens = plain / drafted
        return tokens, cost, p.cost(rows, 1)

    def pays(self, rows: int) -> bool:
        tokens, cost, plain = self._step(rows)
        return pays(tokens, cost, plain, self.policy.slack)

    def could_pay(self, rows: int) -> bool:
        """Would the running mean pay after one more drafted step that had every draft accepted?"""
        tokens, cost, plain = self._step(rows)
        best = (tokens * self.drafted + self.widest + 1) / (self.drafted + 1)
        return pays(best, cost, plain, self.policy.slack)

    def hopeless(self, rows: int) -> bool:
        """Do drafted steps bring less than half the extra tokens they would need to pay?"""
        tokens, cost, plain = self._step(rows)
        need = (1.0 - self.policy.slack) * cost / plain
        return tokens - 1.0 < 0.5 * (need - 1.0)

    def plan(self, ids, remaining):
        self.rows_left = list(zip(ids, remaining))
        rows, p = len(ids), self.policy
        if not p.gate:
            return None
        probe = p.probe_nodes(rows)
        if probe == 0:  # no tree of the drafter's could pay at this batch size
            return 0
        if self.learning():
            return None if self.learn_whole else probe
        if self.pays(rows):
            return None
        return probe if self.backoff.probe() else 0

    def verify(self, trees, draft_seconds):
        p = self.policy
        if not p.cut:
            return trees
        rows = len(trees)
        spent = p.draft_seconds(rows) if all(s is None for s in draft_seconds) else sum(s or 0.0 for s in draft_seconds)
        return value_cut(trees, p.cost, spent)

    def record(self, ids, trees, emitted, draft_seconds):
        p, rows = self.policy, len(ids)
        if not p.gate:
            return
        paid_before = self.learning() or self.pays(rows)
        width = max(t.num_nodes for t in trees)
        full = p.draft_seconds(rows)
        spent = None if all(s is None for s in draft_seconds) else sum(s or 0.0 for s in draft_seconds)
        share = 1.0 if spent is None or full <= 0 else spent / full
        mean, prior_tokens = sum(emitted) / rows, self.tokens
        self.drafted += 1
        self.samples += rows
        w = max(1.0 - p.memory, 1.0 / self.drafted)
        self.tokens += w * (mean - self.tokens)
        self.width += w * (width - self.width)
        self.share += w * (share - self.share)
        self.widest = max(self.widest, width)
        for i, e in zip(ids, emitted):  # a row's mean starts from what earlier runs learnt, if they did
            n = self.row_drafted[i] = self.row_drafted.get(i, self.prior) + 1
            before = self.row_tokens.get(i, prior_tokens if self.prior else e)
            self.row_tokens[i] = before + max(1.0 - p.memory, 1.0 / n) * (e - before)
        if self.rows_left:
            self.rows_left = [(i, left - e) for (i, left), e in zip(self.rows_left, emitted)]
        learnt = p.learnt
        learnt.drafted += 1
        w = max(1.0 - p.memory, 1.0 / learnt.drafted)
        learnt.tokens += w * (mean - learnt.tokens)
        learnt.width += w * (width - learnt.width)
        learnt.share += w * (share - learnt.share)
        if self.learning() and not self.could_pay(rows):  # more learning could not show that it pays
            self.samples = p.min_drafted
        learnt.settled = learnt.settled or not self.learning()
        pays_now = self.learning() or self.pays(rows)
        hopeless = not pays_now and not paid_before and self.hopeless(rows)
        self.backoff.learn(paid_before, pays_now, hopeless)
        if pays_now or not paid_before:  # a step that paid, or a probe: what the next run starts from
            learnt.interval = self.backoff.interval


class Profile(DraftPolicy):
    """The drafts per row a speculation profile found to pay at each batch size (0: plain steps there)."""

    name = "profile"

    def __init__(self, budget: Callable[[int], int]):
        self.budget = budget

    def run(self, rows: int) -> PolicyRun:
        return _ProfileRun(self.budget)


class _ProfileRun(PolicyRun):
    def __init__(self, budget: Callable[[int], int]):
        self.budget = budget

    def plan(self, ids, remaining):
        return self.budget(len(ids))


def schedule_budget(profile: dict, target) -> Callable[[int], int]:
    """The node budget per row for a live batch size, from a profile's schedule: a batch size between two
    measured ones takes the smaller one's drafts (as :func:`vllm_ranges` does), 0 where drafting is off.

    A profile measured for another target would mislead (its acceptance and costs are another model's):
    refused. One measured on another machine is used with a warning, since only its costs differ."""
    from selfdraft.machine import describe

    surface = profile["surface"]
    if surface.get("target") != target.identity.name:
        raise SelfdraftError(f"the drafter's speculation profile was measured with target {surface.get('target')!r}, "
                             f"not {target.identity.name!r}: its schedule does not hold here. Rewrite it with "
                             f"`selfdraft costs --target {target.identity.name} --drafter FOLDER`, or decode with "
                             "speculation='off'")
    here, there = describe(str(target.device)), surface.get("machine") or {}
    differs = [k for k in ("cpu", "cpu_flags", "gpu", "cpus", "threads") if here.get(k) != there.get(k)]
    if differs:
        logger.warning(
            "the drafter's speculation profile was measured on another machine (%s differ: %s there, %s here); its "
            "schedule is used, but `selfdraft costs --drafter FOLDER` here would fit this one",
            ", ".join(differs), {k: there.get(k) for k in differs}, {k: here.get(k) for k in differs})
    entries = profile["entries"]

    def budget(rows: int) -> int:
        return next(tokens for batch, tokens in reversed(entries) if batch <= rows)

    return budget


def policy_for(target, drafter, name: str = "auto", *, folder: str | None = None, rows: int = 1) -> DraftPolicy:
    """The policy ``name`` (:data:`POLICIES`) for ``drafter`` with ``target``, for batches of up to ``rows``
    rows: this machine's cost surface (measured once and cached) and the drafter's measured proposal cost;
    ``folder``: the drafter folder, whose speculation profile ``profile`` (and ``auto`` for a batch) follows."""
    from selfdraft.inference.cost_report import read_profile
    from selfdraft.inference.costs import batch_draft_cost, cost_sizes, cost_surface
    from selfdraft.inference.drafters import Drafter

    if name not in POLICIES:
        raise SelfdraftError(f"unknown drafting policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name == "fixed" or drafter.max_nodes <= 0:
        return FIXED
    wanted = name == "profile" or (name == "auto" and rows > 1)
    profile = read_profile(folder) if folder is not None and wanted else None
    if name == "profile" and profile is None:
        raise SelfdraftError(f"policy 'profile' needs a drafter folder with a speculation profile; {folder or drafter.name} "
                             "has none (write one with `selfdraft costs --drafter FOLDER`), or use policy 'adaptive'")
    if profile is not None:
        return Profile(schedule_budget(profile, target))
    if rows == 1:  # batch 1's row, at every size up to the largest tree
        batches, tokens = (1,), cost_sizes(max(COST_TOKENS, drafter.max_nodes + 1))
    else:
        batches = tuple(sorted({1, 4, 16} | ({rows} if rows > 16 else set())))
        tokens = tuple(sorted({1, 2, 4, 8, 16, 32} | ({drafter.max_nodes + 1} if drafter.max_nodes >= 32 else set())))
    # A drafter whose proposal may cost less than its measured cost (a hybrid resting its drafter) gets no
    # bound from its most expensive proposal.
    varies = type(drafter).step_seconds is not Drafter.step_seconds
    return Adaptive(cost_surface(target, batches, tokens), batch_draft_cost(target, drafter, batches), gate=name != "cut",
                    most_nodes=None if varies else drafter.max_nodes)
