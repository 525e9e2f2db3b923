"""The tasks (prompt sets) a bench runs, and the parsing of task and temperature lists."""

from __future__ import annotations

import os
from typing import Sequence

from selfdraft.errors import SelfdraftError
from selfdraft.inference.prompts import (
    MT_BENCH_CATEGORIES, Prompt, humaneval_prompts, jsonl_prompts, mt_bench_prompts, round_robin,
)

TASKS = ("mt_bench", *(f"mt_bench:{c}" for c in MT_BENCH_CATEGORIES), "humaneval")


def task_prompts(task: str, limit: int | None) -> list[Prompt]:
    """The prompts of a task: ``mt_bench`` (round robin over the 8 categories), ``mt_bench:<category>``,
    ``humaneval``, or a JSONL file path (see :func:`~selfdraft.inference.prompts.jsonl_prompts`)."""
    if task == "mt_bench":
        return round_robin(mt_bench_prompts(), limit)
    if task.startswith("mt_bench:") and task[len("mt_bench:"):] in MT_BENCH_CATEGORIES:
        category = task[len("mt_bench:"):]
        return [p for p in mt_bench_prompts() if p.category == category][:limit]
    if task == "humaneval":
        return humaneval_prompts(limit)
    if os.path.isfile(task):
        return jsonl_prompts(task, limit)
    if os.path.exists(task):
        raise SelfdraftError(f"task {task} is a folder; give a JSONL prompts file")
    if task.endswith(".jsonl") or os.sep in task:
        raise SelfdraftError(f"prompts file {task} does not exist")
    raise SelfdraftError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}, or the path of a JSONL prompts file")


def _split(value: str | Sequence[str]) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else list(value)


def parse_temperatures(value: str | Sequence[float]) -> list[float]:
    items = _split(value) if isinstance(value, str) else list(value)
    try:
        temps = [float(t) for t in items]
    except ValueError:
        raise SelfdraftError(f"temperatures must be numbers >= 0 (0 is greedy), got {value!r}") from None
    if not temps or any(not t >= 0 for t in temps) or len(set(temps)) != len(temps):
        raise SelfdraftError(f"temperatures must be distinct numbers >= 0 (0 is greedy), got {value!r}")
    return temps
