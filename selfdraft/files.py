"""File-system helpers for the atomic writers (drafter folders, exports, reports, the joined target).

``tempfile.mkstemp`` and ``mkdtemp`` create their entries private (0600 / 0700) whatever the umask,
and so does safetensors' ``save_file`` (also under ``save_pretrained``). Renamed into place, that
mode would survive: an exported drafter unreadable by the serving engine's user, a report a
colleague cannot open. The writers reset the mode to what a plain ``open()`` / ``mkdir()`` would
have given before they rename.
"""

from __future__ import annotations

import os
import pathlib
import tempfile


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """selfdraft's cache folder: ``cache_dir``, else ``$SELFDRAFT_CACHE``, else ``~/.cache/selfdraft`` (not created here)."""
    return pathlib.Path(cache_dir or os.environ.get("SELFDRAFT_CACHE") or "~/.cache/selfdraft").expanduser()


def _umask() -> int:
    # /proc (Linux >= 4.7) reads the mask without changing it; os.umask() must set it to read it,
    # which for a moment changes the mode of files that other threads create.
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_if_created(path: str | os.PathLike) -> None:
    """Give ``path``, and everything under it if it is a folder, the mode open()/mkdir() would have:
    0666 for files and 0777 for folders, less the umask."""
    mask = _umask()
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file in the same folder, renamed into
    place with the mode open() would have given: a reader sees the old file or the new one, never half."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        as_if_created(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
