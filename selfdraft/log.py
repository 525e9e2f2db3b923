"""Logging for selfdraft: one rank-aware handler on the ``selfdraft`` logger, set up by the entry points.

Every module logs through ``logging.getLogger(__name__)``, so its records reach the ``selfdraft``
logger. :func:`setup_logging` gives that logger one handler, which writes to ``sys.stderr`` (whatever
it is when a record is emitted), one line per record::

    selfdraft: converting built-in target smollm2-135m to safetensors in ...
    selfdraft: warning: none is not token-identical to ...
    selfdraft[rank 1/4]: error: ...                       # a process of a multi-process launch

When a launcher (``accelerate launch``, ``torchrun``, DeepSpeed's) started several processes, it set
``RANK`` and ``WORLD_SIZE``: every line then names its process, and only the main process (rank 0)
logs INFO, the others warnings and errors only, so N processes do not print each progress line N times.

The ``selfdraft`` command and ``python -m selfdraft.train`` call :func:`setup_logging`; a program that
uses the Python API calls it too to see the progress lines (without it, Python's last-resort handler
prints warnings and errors only, and nothing where the program configured logging itself). Records
still propagate to the root logger, so an application's own handlers and pytest's ``caplog`` see them.
The root logger is not touched.

This module imports only the standard library: the CLI's ``--help`` loads it.
"""

from __future__ import annotations

import logging
import os
import sys

from selfdraft.errors import SelfdraftError

LOGGER = "selfdraft"
LEVEL_ENV = "SELFDRAFT_LOG_LEVEL"
"""Environment variable read when :func:`setup_logging` is given no level (e.g. ``DEBUG``)."""


def process_rank() -> tuple[int, int]:
    """(rank, world size) of this process as the launcher set them in ``RANK`` and ``WORLD_SIZE``;
    (0, 1) for a process that no launcher started. Logging must not fail on an unreadable value: it
    counts as unset."""
    def read(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    rank = max(read("RANK", 0), 0)
    return rank, max(read("WORLD_SIZE", 1), rank + 1)


class _StderrHandler(logging.StreamHandler):
    """A stream handler on the ``sys.stderr`` of the moment a record is emitted (a redirection made
    after setup, pytest's capsys), as the standard library's last-resort handler does."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property decides
        pass


class _Formatter(logging.Formatter):
    """``PREFIX: message``, with ``warning: `` or ``error: `` before the message above INFO."""

    def __init__(self, prefix: str) -> None:
        super().__init__("%(message)s")
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)  # the message, and a traceback where one was logged
        kind = "" if record.levelno < logging.WARNING else "warning: " if record.levelno < logging.ERROR else "error: "
        return f"{self.prefix}: {kind}{text}"


def _level(level: int | str | None) -> int:
    if level is None:
        level = os.environ.get(LEVEL_ENV) or logging.INFO
    if isinstance(level, str):
        named = logging.getLevelName(level.strip().upper())
        if not isinstance(named, int):
            raise SelfdraftError(f"unknown log level {level!r} (from the argument or ${LEVEL_ENV}); use DEBUG, INFO, "
                                 "WARNING or ERROR")
        level = named
    return int(level)


def setup_logging(level: int | str | None = None, *, all_ranks: bool = False) -> logging.Logger:
    """Give the ``selfdraft`` logger its stderr handler and level; returns that logger.

    ``level``: a ``logging`` level or its name; None reads ``$SELFDRAFT_LOG_LEVEL``, else INFO. A
    process other than the main one (``RANK`` > 0) logs at WARNING or above unless ``all_ranks``.
    Idempotent: a second call replaces the handler of the first (so a change of rank or level takes
    effect) and never adds a second one. The root logger and its handlers are left as they are.
    """
    rank, world = process_rank()
    wanted = _level(level)
    if rank != 0 and not all_ranks:
        wanted = max(wanted, logging.WARNING)
    logger = logging.getLogger(LOGGER)
    for old in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(old)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter(f"{LOGGER}[rank {rank}/{world}]" if world > 1 else LOGGER))
    logger.addHandler(handler)
    logger.setLevel(wanted)
    return logger
