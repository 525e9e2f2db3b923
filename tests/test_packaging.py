"""The wheel ships every module and data file of the source tree, under the names it is imported by.

An editable install reads the source folders directly, so a package left out of the packaging config
only shows when selfdraft is installed from a wheel or a plain ``pip install .``. This builds the wheel
(from a clean copy of the checkout, scripts/build_wheel.py) and checks it against the folders that
pyproject.toml's ``[tool.setuptools.package-dir]`` maps into ``selfdraft`` (read from there, as setup.py
reads it) and its ``[tool.setuptools.package-data]``. scripts/check_wheel.sh installs the wheel into a
fresh venv and decodes with it.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import pathlib
import zipfile

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
PACKAGE_DATA: dict[str, list[str]] = SETUPTOOLS.get("package-data", {})


def _build_wheel_module():
    spec = importlib.util.spec_from_file_location("selfdraft_build_wheel", ROOT / "scripts" / "build_wheel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _build_wheel_module()


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    wheel = BUILD.build_wheel(tmp_path_factory.mktemp("wheel"), ROOT)
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def mapped_files() -> dict[str, pathlib.Path]:
    """Every file the build copies from a mapped folder: its path in the wheel -> its path in the checkout."""
    files = BUILD.source_files(ROOT)
    if files is None:  # no git: every file but caches
        files = [p.relative_to(ROOT) for p in ROOT.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    out = {}
    for package, folder in PACKAGE_DIR.items():
        base = pathlib.PurePosixPath(folder)
        for rel in files:
            rel = pathlib.PurePosixPath(rel.as_posix())
            if rel.is_relative_to(base) and "__pycache__" not in rel.parts and rel.suffix != ".pyc":
                out[f"{package.replace('.', '/')}/{rel.relative_to(base)}"] = ROOT / rel
    return out


def folder_of(package: str) -> str:
    """The source folder of ``package`` by the mapping (the longest mapped prefix)."""
    for mapped in sorted(PACKAGE_DIR, key=len, reverse=True):
        if package == mapped or package.startswith(mapped + "."):
            rest = package[len(mapped):].lstrip(".").replace(".", "/")
            return f"{PACKAGE_DIR[mapped]}/{rest}".rstrip("/")
    raise AssertionError(f"package-data names {package!r}, which no [tool.setuptools.package-dir] entry maps")


def test_mapping_is_read():
    assert PACKAGE_DIR.get("selfdraft") == "selfdraft" and len(PACKAGE_DIR) > 1, PACKAGE_DIR
    for folder in PACKAGE_DIR.values():
        assert (ROOT / folder / "__init__.py").is_file(), f"mapped folder {folder}/ has no __init__.py"


def test_every_module_ships(wheel_names):
    modules = {name: path for name, path in mapped_files().items() if name.endswith(".py")}
    assert len(modules) > 20, sorted(modules)
    missing = sorted(name for name in modules if name not in wheel_names)
    hint = sorted({str(modules[m].parent.relative_to(ROOT)) for m in missing})
    assert not missing, (f"the wheel lacks {len(missing)} module(s) of the folders {hint} (setup.py ships the "
                         f"packages it finds under each mapped folder: a folder of modules needs an __init__.py): {missing}")


def test_package_data_ships(wheel_names):
    files = mapped_files()
    declared = set()
    for package, patterns in PACKAGE_DATA.items():
        folder = folder_of(package)
        prefix = package.replace(".", "/") + "/"
        for pattern in patterns:
            hits = {name for name, path in files.items()
                    if name.startswith(prefix) and fnmatch.fnmatch(path.relative_to(ROOT / folder).as_posix(), pattern)}
            assert hits, f"package-data pattern {pattern!r} of {package} matches no file under {folder}/"
            declared |= hits
    missing = sorted(declared - wheel_names)
    assert not missing, f"the wheel lacks declared package data: {missing}"
    # A data file in a package folder that no pattern declares would be missing from installs (the code
    # reads these files at run time, e.g. configs/run.py the YAML presets): declare it or move it out.
    undeclared = sorted(name for name in files if not name.endswith(".py") and name not in wheel_names)
    assert not undeclared, (f"files in the package folders that the wheel lacks: {undeclared}; add them to "
                            "[tool.setuptools.package-data] in pyproject.toml (or move them out of the package folders)")


def test_wheel_holds_only_selfdraft(wheel_names):
    tops = {name.split("/", 1)[0] for name in wheel_names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"selfdraft"}, sorted(tops)
    assert "selfdraft/heads/kinds/block/__init__.py" in wheel_names
    assert any(name.startswith("selfdraft/configs/accelerate/") and name.endswith(".yaml") for name in wheel_names)
