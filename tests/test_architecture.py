"""The package layout and the one-way dependencies of docs/architecture.md, kept by tests."""

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


def side(path: str) -> str:
    """The side of the one-way dependencies a file is on: its top folder, except that a drafter kind's
    folder (heads/kinds/NAME/) holds the kind's training side (objective.py) and decoding side
    (decode.py) beside its heads-level files; the registry reaches those two by import path only."""
    parts = pathlib.PurePath(path).parts
    if parts[:2] == ("heads", "kinds") and parts[-1] in ("objective.py", "decode.py"):
        return {"objective.py": "train", "decode.py": "inference"}[parts[-1]]
    return parts[0]


def kind_side(module: str) -> str | None:
    """``train`` / ``inference`` for a kind's objective / decode module name, else None."""
    if module.startswith("selfdraft.heads.kinds.") and module.rsplit(".", 1)[-1] in ("objective", "decode"):
        return {"objective": "train", "decode": "inference"}[module.rsplit(".", 1)[-1]]
    return None


def sources(*folders: str) -> dict[str, set[str]]:
    found = {}
    for folder in folders:
        found.update(imported_modules(ROOT / folder))
    return found


def test_inference_and_heads_import_no_training_packages():
    for path, names in sources("inference", "heads", "configs").items():
        if side(path) == "train":
            continue
        bad = {n for n in names if n.split(".")[0] in TRAINING_ONLY or n.startswith("selfdraft.train") or kind_side(n) == "train"}
        assert not bad, f"{path} imports training-only modules {sorted(bad)}"


def test_dependencies_point_one_way():
    # configs <- heads <- {train, inference}; a kind's objective.py is train, its decode.py inference
    for path, names in sources("configs", "heads", "inference").items():
        if side(path) == "configs":
            assert not {n for n in names if n.startswith(("selfdraft.heads", "selfdraft.inference", "selfdraft.train"))}, path
        elif side(path) == "heads":
            assert not {n for n in names if n.startswith(("selfdraft.inference", "selfdraft.train")) or kind_side(n)}, path
        elif side(path) == "inference":
            assert not {n for n in names if n.startswith("selfdraft.train") or kind_side(n) == "train"}, path


def test_every_kind_folder_keeps_its_sides_apart():
    folders = [p for p in (ROOT / "heads" / "kinds").iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    assert folders, "no kind folders found"
    for folder in folders:
        for path, names in imported_modules(folder).items():
            if side(path) == "inference":
                assert not {n for n in names if n.split(".")[0] in TRAINING_ONLY}, path


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
    """``import selfdraft``, and building the CLI's parser as ``selfdraft --help`` does (every subcommand's
    options, their defaults read from the config dataclasses), import neither torch nor transformers."""
    code = ("import sys, selfdraft, selfdraft.cli, selfdraft.log; selfdraft.log.setup_logging(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules); "
            "parser = selfdraft.cli.build_parser(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules, len(parser.format_help()) > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["False", "False", "False", "False", "True"], out.stdout


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (of modules, classes, functions, attributes)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def test_no_shared_module_names_a_kind():
    """A kind lives in its folder (heads/kinds/NAME/): outside it, no module of the package compares or
    builds a kind's name, imports a kind's module by name, or holds an identifier named after a kind;
    they ask the registry. Prose (docstrings, messages) may mention the kinds, as users know them."""
    import re

    from selfdraft.heads.kinds import registered

    kinds = registered()
    names = set(kinds) | {kind.section[0] for kind in kinds.values() if kind.section}
    folders = {f"selfdraft.heads.kinds.{p.name}" for p in (ROOT / "heads" / "kinds").iterdir() if p.is_dir()}
    word = re.compile("|".join(sorted((re.escape(k) for k in kinds), key=len, reverse=True)), re.IGNORECASE)
    found = []
    for folder in ("selfdraft", "configs", "heads", "train", "inference"):
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if relative.parts[:2] == ("heads", "kinds") and len(relative.parts) > 3:
                continue
            tree = ast.parse(path.read_text())
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                hit = None
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    hit = node.value if node.value in names else None
                elif isinstance(node, ast.Name) and word.search(node.id):
                    hit = node.id
                elif isinstance(node, ast.Attribute) and word.search(node.attr):
                    hit = node.attr
                elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and word.search(node.name):
                    hit = node.name
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(tuple(folders)):
                    hit = node.module
                if hit:
                    found.append(f"{relative}:{node.lineno}: {hit}")
    assert not found, "shared modules name drafter kinds:\n" + "\n".join(found)


def test_no_function_outside_the_tests_is_longer_than_a_reader_can_hold():
    """About 80 lines at most (docstring and signature included) for a function or method of the package
    and its scripts: a longer one is split into the steps it takes."""
    longest = 85
    found = []
    for folder in ("selfdraft", "configs", "heads", "train", "inference", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > longest:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not found, f"functions over {longest} lines:\n" + "\n".join(found)
