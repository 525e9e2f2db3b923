"""Package discovery for the source layout (the rest of the packaging config is in pyproject.toml).

pyproject.toml's ``[tool.setuptools.package-dir]`` maps top-level folders into the import package
``selfdraft`` (``heads/`` -> ``selfdraft.heads``, ...). setuptools' own discovery cannot add that prefix,
so every package under each mapped folder is found here and named under its mapping: a new subpackage
(a folder with an ``__init__.py``) ships without being listed anywhere. tests/test_packaging.py checks the
built wheel against the source tree.
"""

import pathlib

from setuptools import find_packages, setup

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pyproject's build requirements bring tomli
    import tomli as tomllib

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE_DIR = tomllib.loads((HERE / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]


def discovered(package_dir: dict[str, str]) -> list[str]:
    """Every package under each mapped folder, named under its mapping (the mapped packages themselves included)."""
    names = set()
    for package, folder in package_dir.items():
        names.add(package)
        names.update(f"{package}.{sub}" for sub in find_packages(where=str(HERE / folder)))
    return sorted(names)


setup(packages=discovered(PACKAGE_DIR), package_dir=PACKAGE_DIR)
