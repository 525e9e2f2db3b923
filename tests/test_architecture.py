"""The package layout and the one-way dependencies of DESIGN.md, kept by tests."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAINING_ONLY = {"deepspeed", "wandb", "peft", "datasets", "accelerate"}


def imported_modules(folder: pathlib.Path) -> dict[str, set[str]]:
    found = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_inference_and_heads_import_no_training_packages():
    for folder in ("inference", "heads", "configs"):
        for path, names in imported_modules(ROOT / folder).items():
            bad = {n for n in names if n.split(".")[0] in TRAINING_ONLY or n.startswith("selfdraft.train")}
            assert not bad, f"{path} imports training-only modules {sorted(bad)}"


def test_dependencies_point_one_way():
    # configs <- heads <- {train, inference}
    for path, names in imported_modules(ROOT / "configs").items():
        assert not {n for n in names if n.startswith(("selfdraft.heads", "selfdraft.inference", "selfdraft.train"))}, path
    for path, names in imported_modules(ROOT / "heads").items():
        assert not {n for n in names if n.startswith(("selfdraft.inference", "selfdraft.train"))}, path


def test_installed_layout_has_no_top_level_heads_or_train():
    # Outside the checkout (cwd "/"), only selfdraft.* is importable.
    code = (
        "import importlib.util as u\n"
        "for n in ('heads', 'train', 'inference', 'configs'):\n"
        "    print(n, u.find_spec(n) is not None, u.find_spec('selfdraft.' + n) is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    for line in out.stdout.splitlines():
        name, top, nested = line.split()
        assert (top, nested) == ("False", "True"), f"{name}: top-level importable={top}, selfdraft.{name} importable={nested}"


def test_import_selfdraft_is_light():
    code = "import sys, selfdraft, selfdraft.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["False", "False"], out.stdout
