"""README and docs/ (docs/results/ included) name only files the repository has, and point nowhere outside it.

Every repository path they name (``heads/...``, ``tests/...``, ``scripts/...``, ...) and every relative
link must exist; the files README's layout section lists beside each folder must be in that folder.
Paths a command writes (``runs/``, ``quickstart/``, ``OUT/``) are not repository paths and are not read.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/results/ included
TOP = ("heads", "train", "inference", "configs", "selfdraft", "scripts", "tests", "docs", ".ci")
REPO_PATH = re.compile(r"(?<![\w/.~-])((?:%s)/[\w./-]*[\w/])" % "|".join(re.escape(t) for t in TOP))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


PLACEHOLDER = re.compile(r"(^|/)[A-Z][A-Z_]{2,}(/|$)")  # heads/kinds/NAME/: a template, not a path
CODE = [p for top in TOP[:7] for p in sorted((ROOT / top).rglob("*.py"))] + sorted((ROOT / "scripts").glob("*.sh"))


def named_paths(page: pathlib.Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    return {path for m in REPO_PATH.finditer(text) if not PLACEHOLDER.search(path := m.group(1).rstrip("."))}


def test_every_repository_path_the_docs_name_exists():
    missing = [f"{page.relative_to(ROOT)}: {path}" for page in PAGES for path in sorted(named_paths(page))
               if not (ROOT / path).exists()]
    assert not missing, "README/docs name files the repository does not have:\n" + "\n".join(missing)


def test_every_repository_path_the_code_names_exists():
    """Docstrings and comments cite files by their repository path (or their installed one,
    ``selfdraft/heads/...``); each must be there. Only names of files are read: ``train/loss`` is a metric."""
    def exists(named: str) -> bool:
        installed = re.match(r"selfdraft/(heads|train|inference|configs)/(.*)", named)
        return (ROOT / named).exists() or bool(installed and (ROOT / installed[1] / installed[2]).exists())

    missing = [f"{path.relative_to(ROOT)}: {named}" for path in CODE for named in sorted(named_paths(path))
               if named.endswith((".py", ".md", ".sh", ".yaml", ".toml")) and not exists(named)]
    assert not missing, "code names files the repository does not have:\n" + "\n".join(missing)


def test_every_relative_link_resolves_inside_the_repository():
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, "links that do not resolve inside the repository:\n" + "\n".join(bad)


def test_nothing_points_outside_the_repository():
    for path in [*PAGES, *CODE]:
        text = path.read_text(encoding="utf-8")
        assert "../" + "shared" not in text and "DESIGN" + ".md" not in text, path


def test_the_layout_section_is_true():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text[text.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    problems = []
    for line in block.strip().splitlines():
        folder = line.split()[0].rstrip("/")
        if not (ROOT / folder).is_dir():
            problems.append(f"{folder}/ is not a folder")
            continue
        for name in re.findall(r"[\w/]+\.(?:py|sh)\b", line):
            if not (ROOT / folder / name).exists() and not (ROOT / name).exists():
                problems.append(f"{folder}/{name} does not exist")
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "__init__.py").exists()}
    listed = {line.split()[0].rstrip("/") for line in block.strip().splitlines()}
    problems += [f"package folder {name}/ is not in the layout" for name in sorted(top - listed)]
    assert not problems, "README's layout section:\n" + "\n".join(problems)
