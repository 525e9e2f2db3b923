"""selfdraft/log.py: one handler on the ``selfdraft`` logger, lines that name their process under a
multi-process launch, quiet non-main processes, idempotent, the root logger left alone."""

import logging
import os
import subprocess
import sys

import pytest

from selfdraft.errors import SelfdraftError
from selfdraft.log import LEVEL_ENV, process_rank, setup_logging


@pytest.fixture
def clean_logging(monkeypatch):
    """The ``selfdraft`` logger as it was before the test (the suite may have set it up)."""
    logger = logging.getLogger("selfdraft")
    handlers, level = logger.handlers[:], logger.level
    for name in ("RANK", "WORLD_SIZE", LEVEL_ENV):
        monkeypatch.delenv(name, raising=False)
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def _said(capsys, emit) -> list[str]:
    capsys.readouterr()
    emit(logging.getLogger("selfdraft.some.module"))
    return capsys.readouterr().err.splitlines()


def test_a_non_main_rank_names_itself_and_is_quiet_at_info(clean_logging, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert process_rank() == (1, 4)
    setup_logging()
    assert _said(capsys, lambda log: log.info("progress")) == []
    assert _said(capsys, lambda log: log.warning("careful")) == ["selfdraft[rank 1/4]: warning: careful"]
    assert _said(capsys, lambda log: log.error("broken")) == ["selfdraft[rank 1/4]: error: broken"]
    setup_logging(all_ranks=True)
    assert _said(capsys, lambda log: log.info("progress")) == ["selfdraft[rank 1/4]: progress"]

    monkeypatch.setenv("RANK", "0")
    setup_logging()  # the main process of the same launch logs INFO
    assert _said(capsys, lambda log: log.info("step %d", 3)) == ["selfdraft[rank 0/4]: step 3"]
    assert _said(capsys, lambda log: log.debug("detail")) == []


def test_one_process_plain_prefix_idempotent_and_root_untouched(clean_logging, monkeypatch, capsys):
    root = logging.getLogger()
    root_state = root.handlers[:], root.level
    setup_logging()
    setup_logging()
    ours = [h for h in clean_logging.handlers if type(h).__name__ == "_StderrHandler"]
    assert len(ours) == 1, clean_logging.handlers
    assert (root.handlers[:], root.level) == root_state
    assert _said(capsys, lambda log: log.info("converting")) == ["selfdraft: converting"]
    assert _said(capsys, lambda log: log.warning("careful")) == ["selfdraft: warning: careful"]

    setup_logging("warning")
    assert _said(capsys, lambda log: log.info("converting")) == []
    monkeypatch.setenv(LEVEL_ENV, "DEBUG")
    setup_logging()
    assert _said(capsys, lambda log: log.debug("detail")) == ["selfdraft: detail"]
    with pytest.raises(SelfdraftError, match="DEBUG, INFO"):
        setup_logging("loud")


def test_the_cli_logs_its_errors_with_the_rank(tmp_path):
    """A user error in the second process of a launch: one line that names the process, exit status 2."""
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "selfdraft", "bench", "--tasks", "nope", "--out", str(tmp_path / "b")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("selfdraft[rank 1/2]: error: unknown task 'nope'"), proc.stderr
    assert "Traceback" not in proc.stderr
