"""How many optimizer steps a run takes: ``train.max_steps``, or as many as its time budget holds.

With ``train.time_budget_minutes`` set, the budget is a deadline for the seconds spent in optimizer
steps (loading, evaluation and saving come on top), and ``train.max_steps`` is only the first plan.
A plan made from a few timed steps goes wrong when the machine was busier (or idler) while they were
timed than while the run trains; so the run re-plans from the step times it measures as it trains:

* after every step, the steps that still fit are the budget left divided by the median of the last
  :data:`WINDOW` step times, and the planned total becomes the steps done plus those; a change
  smaller than :data:`TOLERANCE` of the total is ignored, so that noise does not re-target the
  schedule at every step;
* the first re-plan waits for :data:`MIN_MEASURED` step times (their median is not the first step's
  one-off costs), unless the planned total is reached before;
* when not one more step fits (or the budget is spent), the total becomes the steps done: the run
  finishes there, with its final evaluation and export, and overshoots the deadline by at most the
  part of a step that ran slower than the median;
* the total never passes ``limit`` (a feature cache that covers only so many steps).

The learning-rate schedule (warm-up, then cosine to ``min_lr_ratio`` at the total) follows the plan:
the learning rate of step s is computed with the total planned when step s begins, so a re-plan
re-targets the rest of the cosine to the new total from the current step on, and the steps already
taken keep theirs. The plan's state (total, seconds spent, the recent step times) is saved in every
checkpoint: a resumed run re-plans from the same numbers, so with the same step times it continues
exactly as the uninterrupted run would have (with other step times, it re-plans from the checkpoint's
budget left). Under several processes the slowest process's step time counts, so all make the same plan.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

WINDOW = 10
"""Recent step times whose median estimates the next steps."""

MIN_MEASURED = 3
"""Step times measured before the first re-plan."""

TOLERANCE = 0.01
"""Re-plans that move the total by at most this share of it are ignored."""

StepTimer = Callable[[], Callable[[], float]]
"""Starts a step's stopwatch; the callable it returns gives the seconds since (a test scripts both)."""


def stopwatch() -> Callable[[], float]:
    """The default :data:`StepTimer`: wall-clock seconds from ``time.perf_counter``."""
    began = time.perf_counter()
    return lambda: time.perf_counter() - began


@dataclasses.dataclass
class StepPlan:
    """The planned number of optimizer steps of a run, and what re-planning it needs."""

    total: int
    """Steps the run takes, as planned now."""
    budget_seconds: float | None = None
    """Seconds of optimizer steps the run may spend; None: no deadline, ``total`` is fixed."""
    spent_seconds: float = 0.0
    """Seconds of optimizer steps spent so far, over every resumed part of the run."""
    recent: list[float] = dataclasses.field(default_factory=list)
    """The last :data:`WINDOW` step times, oldest first."""
    limit: int | None = None
    """The most steps the run can take (None: no limit); not saved, it comes from the run's data."""

    @classmethod
    def for_run(cls, max_steps: int, time_budget_minutes: float | None, saved: dict[str, Any] | None = None,
                limit: int | None = None) -> StepPlan:
        """The plan of a run: a fresh one, or the one a checkpoint saved (:meth:`state`). Without a
        budget the total is ``max_steps`` even when resuming (a resumed run may be extended); with
        one, the saved total goes on."""
        saved = saved or {}
        budget = time_budget_minutes * 60 if time_budget_minutes else None
        total = saved.get("total", max_steps) if budget is not None else max_steps
        plan = cls(total=total, budget_seconds=budget, spent_seconds=float(saved.get("spent_seconds", 0.0)),
                   recent=[float(s) for s in saved.get("recent", [])], limit=limit)
        if limit is not None:
            plan.total = min(plan.total, limit)
        return plan

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON)."""
        return {"total": self.total, "budget_seconds": self.budget_seconds, "spent_seconds": self.spent_seconds,
                "recent": list(self.recent)}

    def record(self, done: int, seconds: float) -> None:
        """Count step ``done`` (1-based) of ``seconds`` and, under a budget, re-plan the total."""
        self.spent_seconds += seconds
        self.recent = [*self.recent, seconds][-WINDOW:]
        if self.budget_seconds is None:
            return
        left = self.budget_seconds - self.spent_seconds
        if left <= 0:
            self.total = done
            return
        if len(self.recent) < MIN_MEASURED and done < self.total:
            return
        fit = done + int(left // statistics.median(self.recent))
        if self.limit is not None:
            fit = min(fit, self.limit)
        if fit <= done:  # not one more step ends by the deadline
            self.total = done
        elif done >= self.total or abs(fit - self.total) > TOLERANCE * self.total:
            self.total = fit
