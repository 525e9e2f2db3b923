"""Build selfdraft's wheel from a clean copy of the source tree: ``python scripts/build_wheel.py OUT_DIR``.

The files a checkout ships (tracked, and untracked but not ignored, as ``git ls-files`` lists them; without
git, every file but the usual build and venv folders) are copied into a temporary folder and the wheel is
built there (``pip wheel --no-deps --no-build-isolation``: the running interpreter needs setuptools>=68), so a
stale ``build/`` or ``*.egg-info`` left in the checkout by an earlier build can neither put into the wheel a
file that the packaging config leaves out nor be changed by this build. Prints the wheel's path last.
Used by tests/test_packaging.py and scripts/check_wheel.sh.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
NOT_SOURCE = (".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.pyc")


def source_files(repo: pathlib.Path = REPO) -> list[pathlib.Path] | None:
    """The checkout's files as git sees them (relative paths), or None where git cannot list them."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    names = {pathlib.Path(n) for n in out.decode().split("\0") if n}
    return sorted(n for n in names if (repo / n).is_file())  # a tracked file deleted in the work tree is gone


def copy_source(dest: pathlib.Path, repo: pathlib.Path = REPO) -> pathlib.Path:
    """A clean copy of the checkout in ``dest`` (made here); returns ``dest``."""
    files = source_files(repo)
    if files is None:
        shutil.copytree(repo, dest, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
        return dest
    dest.mkdir(parents=True)
    for name in files:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, dest / name, follow_symlinks=False)
    return dest


def build_wheel(out_dir: pathlib.Path, repo: pathlib.Path = REPO) -> pathlib.Path:
    """Build the wheel of ``repo`` into ``out_dir`` from a clean copy; returns the wheel's path."""
    out_dir = pathlib.Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*.whl"))
    with tempfile.TemporaryDirectory(prefix="selfdraft-src-") as tmp:
        src = copy_source(pathlib.Path(tmp) / "src", repo)
        cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
               "--disable-pip-version-check", "-w", str(out_dir), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip wheel failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    made = sorted(set(out_dir.glob("selfdraft-*.whl")) - before) or sorted(out_dir.glob("selfdraft-*.whl"))
    if len(made) != 1:
        raise RuntimeError(f"expected one selfdraft wheel in {out_dir}, found {[p.name for p in made]}")
    return made[0]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/build_wheel.py OUT_DIR", file=sys.stderr)
        return 2
    try:
        print(build_wheel(pathlib.Path(argv[0])))
    except RuntimeError as err:
        print(f"build_wheel: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
