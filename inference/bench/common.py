"""What every part of the benchmark shares: the baseline's name, atomic writes, result groups."""

from __future__ import annotations

import os
import pathlib
import tempfile

from selfdraft.files import as_if_created

BASELINE = "none"


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        as_if_created(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _groups(results: dict) -> list[tuple[str, float, list[dict]]]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in results["rows"]:
        groups.setdefault((row["task"], row["temperature"]), []).append(row)
    return [(task, t, rows) for (task, t), rows in groups.items()]
