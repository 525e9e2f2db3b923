"""The speculation schedule: for each batch size, how many tokens a chain drafter should propose, from its
per-position acceptance and this machine's costs.

A chain of k drafts whose i-th token is accepted (given the ones before it were) with probability a_i
emits E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per step (depths taken as independent, as the
trees' own scoring does). At batch size B a step costs the target's forward over k + 1 tokens per row,
T(B, k + 1) (the measured :class:`~selfdraft.inference.costs.CostSurface`), plus the drafter's
proposal of k drafts, D(B, k); plain decoding emits one token per T(B, 1). So the predicted speedup is

    S(B, k) = E(k) * T(B, 1) / (T(B, k + 1) + D(B, k)),

and the schedule takes, per batch size, the k with the largest S (k = 0, drafting off, where none is
above 1). D is measured at batch 1 and scaled with the target's plain step, D(B, k) = D(1, k) *
T(B, 1) / T(1, 1): both are small forwards bound alike by reading weights and by compute (an
assumption, stated in every profile, that a measurement at B > 1 can check).

inference/cost_report.py writes the schedule into ``speculation_profile.json`` and translates it for vLLM
and SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfdraft.errors import SelfdraftError
from selfdraft.inference.costs import CostSurface, speedup


def expected_tokens(acceptance, k: int) -> float:
    """E(k): tokens a step emits with a chain of k drafts (the target's own token included)."""
    total, alive = 1.0, 1.0
    for a in list(acceptance)[:k]:
        alive *= a
        total += alive
    return total


@dataclass(frozen=True)
class ScheduleEntry:
    batch: int
    tokens: int
    """Drafts per step at this batch size (0: drafting off)."""
    speedup: float
    """Predicted speedup over plain decoding at this batch size with ``tokens`` drafts."""
    by_tokens: tuple[float, ...]
    """Predicted speedup for 0, 1, ..., max_tokens drafts."""


def plan_schedule(acceptance, surface: CostSurface, draft_seconds) -> list[ScheduleEntry]:
    """The best chain length per batch size of ``surface`` (see the module docstring). ``acceptance``:
    a_1, ..., a_K in [0, 1]; ``draft_seconds[k]``: the drafter's proposal of k drafts at batch 1, for
    k = 1..K (index 0 unused; a drafter that drafts one token per forward costs about k times its
    first, a block drafter about the same for every k)."""
    acceptance = [float(a) for a in acceptance]
    if not acceptance or not all(0.0 <= a <= 1.0 for a in acceptance):
        raise SelfdraftError(f"per-position acceptance must be probabilities in [0, 1], got {acceptance}")
    if len(draft_seconds) != len(acceptance) + 1 or min(draft_seconds) < 0:
        raise SelfdraftError(f"need the drafting cost of 0..{len(acceptance)} drafts (>= 0), got {list(draft_seconds)}")
    max_tokens = len(acceptance)
    plain1 = surface(1, 1)
    entries = []
    for b in surface.batch_sizes:
        plain = surface(b, 1)
        scale = plain / plain1
        by_tokens = tuple(1.0 if k == 0 else speedup(expected_tokens(acceptance, k), surface(b, k + 1) + draft_seconds[k] * scale, plain)
                          for k in range(max_tokens + 1))
        best = max(range(max_tokens + 1), key=lambda k: (by_tokens[k] > 1.0 + 1e-9, by_tokens[k], -k))
        if by_tokens[best] <= 1.0:
            best = 0
        entries.append(ScheduleEntry(b, best, by_tokens[best], by_tokens))
    return entries


#END
