"""How a training budget is spent: online target features or a feature cache, and how much data.

The target is frozen, so its features are a function of the data: computed online they cost the
target's forward in every step, cached they cost it once per conversation and then disk. With ``f``
seconds of target forward and ``c`` seconds of everything else per conversation a step holds:

* one online pass over M conversations costs ``M (f + c)``;
* a cache of N conversations read for E epochs costs ``N (f + E c)``.

So a cache pays exactly when the run reads its conversations more than once, and then it saves
``(E - 1) N f``. Whether a fixed budget is better spent on one online pass over many conversations
or on several epochs over a cached subset is a question of drafter quality, not of arithmetic: the
recipe sweep (``scripts/recipe_sweep.py``, docs/results/recipe-sweep.md) measures it, and
:data:`BUDGET_EPOCHS` holds its answer for :func:`plan_budget`.

* :func:`plan_budget` turns a budget and measured step costs into a plan (the quickstart's first
  plan; the run then re-plans its steps from the step times it measures, ``selfdraft.train.deadline``).
* :func:`resolve_features` makes ``train.features: auto`` concrete (``train()`` calls it before the
  run starts): a cache in ``RUN/features`` when the run reads its data at least
  :data:`MIN_CACHE_EPOCHS` times and the cache fits the disk and ``max_gb``, else online features; it
  says which and why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil
import statistics
from dataclasses import dataclass
from typing import Literal

from selfdraft.errors import SelfdraftError
from selfdraft.train.distributed import fresh_accelerate_state
from selfdraft.train.features import FeatureSource, cache_features

logger = logging.getLogger(__name__)

BUDGET_EPOCHS = 3.0
"""Epochs over a cached subset that :func:`plan_budget` spends a budget on (1: one online pass over as
many conversations as the budget reaches). The recipe sweep's answer (docs/results/recipe-sweep.md):
about three epochs over a cached subset trained as well as one online pass over more
conversations in the same time, and more epochs than that did worse; a cache buys steps more than
accuracy."""

BUDGET_EVIDENCE = "beat one online pass at this budget in the recipe sweep"
"""Why :data:`BUDGET_EPOCHS`: the plan's reason says it."""

MIN_CACHE_EPOCHS = 1.25
"""A cache is written only for runs that read their conversations at least this many times (below,
the target forwards it saves do not pay for the disk and the writing)."""

MAX_CACHE_GB = 20.0
"""The largest cache :func:`resolve_features` and :func:`plan_budget` write without being asked."""


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds of one optimizer step with online features, and of its target forward."""

    seconds_per_step: float
    target_seconds_per_step: float
    conversations_per_step: int
    tokens_per_conversation: float
    """Mean tokens of the conversations timed (the cache's size per conversation follows from it)."""

    @classmethod
    def measured(cls, result, conversations_per_step: int) -> StepCosts:
        """From a short timed run (a :class:`~selfdraft.train.loop.TrainResult`): the median step after
        the first (which pays one-off costs: kernels chosen, buffers allocated), the target's share of
        the time as measured over all of them."""
        times = result.step_seconds[1:] or result.step_seconds
        if not times:
            raise SelfdraftError("no timed step to plan from")
        per_step = statistics.median(times)
        share = result.target_seconds / result.train_seconds if result.train_seconds else 0.0
        tokens = result.train_tokens_per_second * result.train_seconds / (len(result.step_seconds) * conversations_per_step)
        return cls(per_step, share * per_step, conversations_per_step, tokens)

    @property
    def target_per_conversation(self) -> float:  # f
        return self.target_seconds_per_step / self.conversations_per_step

    @property
    def rest_per_conversation(self) -> float:  # c: a cached step's share of one conversation
        return max(self.seconds_per_step - self.target_seconds_per_step, 1e-9) / self.conversations_per_step


@dataclass(frozen=True)
class BudgetPlan:
    features: Literal["online", "cached"]
    conversations: int
    """Distinct training conversations, as rendered (the quickstart asks ``data.max_conversations`` for
    as many as give this many: :func:`selfdraft.train.data.conversations_for`)."""
    steps: int
    epochs: float
    cache_gb: float
    """Disk the cache takes (0 online)."""
    reason: str


def plan_budget(seconds: float, costs: StepCosts, *, available: int, bytes_per_token: int, free_gb: float,
                epochs: float = BUDGET_EPOCHS, evidence: str = BUDGET_EVIDENCE,
                max_gb: float = MAX_CACHE_GB) -> BudgetPlan:
    """Spend ``seconds`` of optimizer steps (and cache writing) on ``available`` conversations at most.

    Online: as many steps as fit, one pass while the data lasts. Cached: N conversations for which
    writing their features and ``epochs`` epochs over them fill the budget (all ``available`` when the
    budget reaches further: then the extra time is more epochs, which online would pay the target's
    forward for again). A cache is chosen when it means at least :data:`MIN_CACHE_EPOCHS` epochs and
    fits ``free_gb`` and ``max_gb``; else online, with the reason. ``evidence`` says why ``epochs``
    (a drafter kind's objective holds both: ``budget_epochs``, ``budget_evidence``)."""
    if seconds <= 0 or costs.seconds_per_step <= 0:
        raise SelfdraftError(f"a budget of {seconds:.0f} s with steps of {costs.seconds_per_step:.2f} s plans nothing")
    cps, f, c = costs.conversations_per_step, costs.target_per_conversation, costs.rest_per_conversation
    online_steps = max(1, int(seconds / costs.seconds_per_step))
    online_reads = online_steps * cps
    online = BudgetPlan("online", min(available, online_reads), online_steps, online_reads / min(available, online_reads),
                        0.0, "")
    n = max(cps, min(available, int(seconds / (f + epochs * c))))
    cached_seconds = (seconds - n * f) / c  # conversation reads the rest of the budget pays for
    steps = max(1, int(cached_seconds / cps))
    gb = n * costs.tokens_per_conversation * bytes_per_token / 1e9
    cached = BudgetPlan("cached", n, steps, steps * cps / n, gb, "")
    if cached.epochs < MIN_CACHE_EPOCHS:
        return dataclasses.replace(online, reason=f"one online pass over {online.conversations} conversations "
                                   f"({online.epochs:.2f} epochs): a cache pays only when conversations are read again")
    if gb > min(max_gb, free_gb):
        limit = f"{max_gb:g} GB allowed" if gb > max_gb else f"{free_gb:.1f} GB free"
        return dataclasses.replace(online, reason=f"online: the cache of {n} conversations would take {gb:.1f} GB "
                                   f"({limit}); one pass over {online.conversations} conversations instead")
    why = (f"the data runs out online ({available} conversations, {online_reads / available:.1f} reads each)"
           if online_reads > available else f"{epochs:g} epochs over a cached subset {evidence}")
    return dataclasses.replace(cached, reason=f"a cache of {n} conversations ({gb:.1f} GB) read for "
                               f"{cached.epochs:.1f} epochs in {steps} steps: {why}")


def resolve_features(config, *, max_gb: float = MAX_CACHE_GB, min_epochs: float = MIN_CACHE_EPOCHS, cpu: bool = False):
    """``config`` with ``train.features: auto`` made concrete: ``RUN/features`` (written now, or resumed)
    when the run reads its training conversations at least ``min_epochs`` times and the cache fits the
    disk and ``max_gb``, else online features (empty). Other values pass through. Under ``accelerate
    launch`` every process calls it and the processes write the cache together. ``cpu``: as
    :func:`~selfdraft.train.loop.train`'s."""
    t = config.train
    if FeatureSource.parse(t.features).kind != "auto":
        return config
    world = int(os.environ.get("WORLD_SIZE", "1"))
    main = int(os.environ.get("RANK", "0")) == 0
    n = config.data.max_conversations
    reads = t.max_steps * t.micro_batch_size * t.grad_accum * world
    folder = pathlib.Path(t.output_dir) / "features"

    def say(text: str) -> None:
        if main:
            print(f"selfdraft: train.features auto: {text}", flush=True)

    def with_features(source: FeatureSource):
        return dataclasses.replace(config, train=dataclasses.replace(t, features=str(source)))

    def online(why: str):
        say(f"online target features ({why})")
        return with_features(FeatureSource("online"))

    if not (folder / "features.json").is_file():  # a cache begun before is always finished
        if n is None:
            return online("data.max_conversations is unset: the run reads a source of unknown size, about once")
        if reads < min_epochs * n:
            return online(f"{t.max_steps} steps read {reads} conversations of {n}, {reads / n:.2f} times each: a "
                          "cache would save few target forwards and cost disk")
        say(f"{t.max_steps} steps read each of data.max_conversations={n} at least {reads / n:.1f} times (more where "
            f"some render no assistant token): caching their features in {folder}")
    try:
        outcome = cache_features(with_features(FeatureSource("online")), folder, max_gb=max_gb, cpu=cpu)
    finally:
        if world > 1:  # cache_features ended its process group: the run starts its own
            fresh_accelerate_state()
    if not outcome.written:
        return online(outcome.size.shortfall())
    return with_features(FeatureSource("cache", folder))


def free_gb(folder: str | os.PathLike) -> float:
    """Free disk space where ``folder`` is (or would be created)."""
    path = pathlib.Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free / 1e9
