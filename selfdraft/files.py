"""File-system helpers for the atomic writers (drafter folders, exports, reports, the joined target).

``tempfile.mkstemp`` and ``mkdtemp`` create their entries private (0600 / 0700) whatever the umask,
and so does safetensors' ``save_file`` (also under ``save_pretrained``). Renamed into place, that
mode would survive: an exported drafter unreadable by the serving engine's user, a report a
colleague cannot open. The writers reset the mode to what a plain ``open()`` / ``mkdir()`` would
have given before they rename.
"""

from __future__ import annotations

import os


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
