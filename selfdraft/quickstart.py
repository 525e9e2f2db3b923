"""``selfdraft quickstart``: the main job on the embedded default, end to end, on a CPU.

    selfdraft quickstart                          # ~25 minutes on a 2-core CPU, offline
    selfdraft quickstart --budget-minutes 5 --out qs/

Stages, each recorded in ``OUT/stages.json`` when it finishes and skipped when the command runs again
(an interrupted stage resumes: training from its last checkpoint):

1. **train** the best drafter we have for the budget (the ``quickstart`` preset: EAGLE-3 on
   SmolLM2-135M-Instruct and the embedded ShareGPT conversations). The first ``calibration_steps``
   steps (inside the warm-up, so the schedule does not depend on the total yet) are timed; the run is
   then resumed with ``max_steps`` set so that it ends within ``--budget-minutes``.
2. **bench** it against the vanilla baseline (our loop without a drafter), prompt lookup and
   transformers' greedy and prompt-lookup decoding on a subset of MT-bench and HumanEval, greedy
   (token identity is checked), and print the table and where the report is.
3. **export** it for vLLM and for SGLang (``OUT/export-vllm``, ``OUT/export-sglang``, each with a
   README.md model card holding the measured acceptance length and its serving command) next to the
   native one.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from dataclasses import dataclass

from selfdraft.errors import SelfdraftError

BENCH_METHODS = ("none", "prompt-lookup", "hf-greedy", "hf-prompt-lookup")
EXPORT_FORMATS = ("vllm", "sglang")


@dataclass(frozen=True)
class QuickstartConfig:
    out: str = "quickstart"
    """Folder for the run, the export and the bench report."""
    budget_minutes: float = 15.0
    """Training time (optimizer steps; loading, evaluation and saving come on top)."""
    config: str = "quickstart"
    """The run preset or YAML file to train."""
    overrides: tuple[str, ...] = ()
    calibration_steps: int = 5
    """Steps timed before the step count is fixed; must not exceed the preset's warm-up."""
    bench_tasks: str = "mt_bench,humaneval"
    bench_limit: int = 6
    """Prompts per task (MT-bench takes its categories in turn)."""
    max_new_tokens: int = 96
    threads: int | None = None
    device: str = "auto"
    """Where it trains and benches: ``auto`` (a GPU where there is one, else the CPU), ``cpu`` or ``cuda``."""


class _Stages:
    """OUT/stages.json: what finished, written atomically after every stage."""

    def __init__(self, folder: pathlib.Path, key: dict):
        self.path = folder / "stages.json"
        self.data = {"key": key, "done": {}}
        if self.path.is_file():
            try:
                old = json.loads(self.path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as err:
                raise SelfdraftError(f"{self.path} is corrupt ({err}): remove it to start the quickstart over") from err
            if old.get("key") != key:
                raise SelfdraftError(f"{folder} holds a quickstart with other settings ({old.get('key')}); "
                                     "choose another --out or remove it")
            self.data = old

    def done(self, stage: str) -> dict | None:
        return self.data["done"].get(stage)

    def finish(self, stage: str, info: dict) -> None:
        self.data["done"][stage] = info
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1), encoding="utf-8")
        os.replace(tmp, self.path)


def measured_acceptance(results: dict, method: str) -> dict | None:
    """The engines' acceptance length of ``method`` over every task of a bench, for a model card."""
    rows = [r for r in results["rows"] if r["method"] == method and r.get("engine_acceptance_length")]
    if not rows:
        return None
    steps = sum(r["target_forwards"] - r["prompts"] for r in rows)
    tokens = sum(r["new_tokens"] - r["prompts"] for r in rows)
    tasks = ", ".join(f"{r['task']} {r['prompts']}" for r in rows)
    return {"acceptance_length": tokens / steps,
            "where": f"1 + accepted per verification step, selfdraft's decoder with the stored tree, greedy, "
                     f"prompts: {tasks}; `selfdraft bench --methods vllm:FOLDER` measures vLLM's chain"}


def _device(name: str) -> str:
    """``auto`` -> cuda where there is a GPU, else cpu. Training goes through accelerate, which takes a
    GPU where there is one: ``cpu`` keeps it on the CPU (ACCELERATE_USE_CPU)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SelfdraftError("--device cuda asked for, but CUDA is not available here; use --device cpu")
    if name not in ("cpu", "cuda"):
        raise SelfdraftError(f"--device must be auto, cpu or cuda, not {name!r}")
    if name == "cpu" and torch.cuda.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "true"
    return name


def _say(message: str) -> None:
    print(f"[quickstart] {message}", flush=True)


def quickstart(qc: QuickstartConfig) -> dict:
    """Run (or resume) the quickstart; returns the bench results. See the module docstring."""
    from selfdraft.configs.run import load_run_config
    from selfdraft.train import checkpoint as ckpt
    from selfdraft.train.loop import train

    if qc.budget_minutes <= 0:
        raise SelfdraftError(f"--budget-minutes must be > 0, got {qc.budget_minutes}")
    device = _device(qc.device)
    out = pathlib.Path(qc.out)
    run_dir = out / "run"
    overrides = [*qc.overrides, f"train.output_dir={run_dir}"]
    config = load_run_config(qc.config, overrides)
    if qc.calibration_steps > config.train.warmup_steps:
        raise SelfdraftError(f"calibration_steps {qc.calibration_steps} exceeds the preset's warm-up "
                             f"({config.train.warmup_steps} steps): the timed steps would depend on the total")
    out.mkdir(parents=True, exist_ok=True)
    stages = _Stages(out, {"config": qc.config, "overrides": list(qc.overrides), "budget_minutes": qc.budget_minutes})
    began = time.perf_counter()

    # 1. train
    if stages.done("train"):
        _say(f"train: done before ({stages.done('train')['steps']} steps), skipped")
    else:
        planned = stages.data.get("planned_steps")
        if planned is None:
            latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
            start = ckpt.read_state(latest)["step"] if latest is not None else 0
            if start + qc.calibration_steps > config.train.warmup_steps:
                raise SelfdraftError(f"{run_dir} holds an unsized run at step {start}: remove {out} to start over")
            _say(f"train: {config.name}, timing {qc.calibration_steps} steps to size the run to "
                 f"{qc.budget_minutes:g} minutes")
            first = train(config, resume=latest is not None, stop_after=start + qc.calibration_steps)
            per_step = first.train_seconds / qc.calibration_steps
            planned = max(first.step + 1, int(qc.budget_minutes * 60 / per_step))
            stages.data["planned_steps"] = planned
            stages.save()
            _say(f"train: {per_step:.2f} s per step -> {planned} steps")
        config = load_run_config(qc.config, [*overrides, f"train.max_steps={planned}"])
        result = train(config, resume=ckpt.latest_checkpoint(run_dir / "checkpoints") is not None)
        if result.drafter_dir is None:
            raise SelfdraftError(f"training stopped at step {result.step} of {planned}; rerun to resume")
        stages.finish("train", {"steps": planned, "drafter": str(result.drafter_dir), "last_eval": result.last_eval})
        _say(f"train: done, drafter in {result.drafter_dir}")
    drafter = pathlib.Path(stages.done("train")["drafter"])

    # 2. bench
    if stages.done("bench"):
        _say(f"bench: done before, report at {stages.done('bench')['report']}, skipped")
        results = json.loads((out / "bench" / "results.json").read_text(encoding="utf-8"))
    else:
        from selfdraft.inference.bench import run_bench

        _say(f"bench: {qc.bench_tasks}, {qc.bench_limit} prompts each, {qc.max_new_tokens} new tokens, greedy")
        results = run_bench(config.target.spec, [*BENCH_METHODS, str(drafter)], qc.bench_tasks, [0.0],
                            qc.max_new_tokens, qc.bench_limit, out / "bench", dtype=config.target.dtype,
                            device=device, threads=qc.threads, command="selfdraft quickstart")
        stages.finish("bench", {"report": str(out / "bench" / "report.md")})

    # 3. export, with the acceptance length the bench measured in each model card
    if stages.done("export"):
        _say(f"export: done before ({', '.join(stages.done('export')['folders'].values())}), skipped")
    else:
        from selfdraft.train.export import export

        acceptance = measured_acceptance(results, str(drafter))
        folders = {}
        for fmt in EXPORT_FORMATS:  # each folder has a README.md with the command that serves it
            folder, message = export(drafter, fmt, out / f"export-{fmt}", acceptance=acceptance)
            folders[fmt] = str(folder)
            _say(f"export: {message}")
        stages.finish("export", {"folders": folders})
    _say(f"finished in {(time.perf_counter() - began) / 60:.1f} minutes this time")
    return results
