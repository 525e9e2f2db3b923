"""What every part of the benchmark shares: the baseline's name, atomic writes, result groups."""

from __future__ import annotations

from selfdraft.files import write_atomic as _write_atomic  # noqa: F401 (the bench's modules import it from here)

BASELINE = "none"


def _groups(results: dict) -> list[tuple[str, float, list[dict]]]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in results["rows"]:
        groups.setdefault((row["task"], row["temperature"]), []).append(row)
    return [(task, t, rows) for (task, t), rows in groups.items()]
