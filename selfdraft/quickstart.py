"""``selfdraft quickstart``: the main job on the embedded default, end to end, on a CPU.

    selfdraft quickstart                          # offline; the training budget is 15 minutes
    selfdraft quickstart --budget-minutes 5 --out qs/

Stages, each recorded in ``OUT/stages.json`` when it finishes and skipped when the command runs again
(an interrupted stage resumes: training from its last checkpoint):

1. **train** the best drafter we have for the budget (the ``quickstart`` preset: DFlash block 4 on
   SmolLM2-135M-Instruct and the embedded ShareGPT conversations). ``calibration_steps`` online
   steps are timed first (the target's forward apart); :func:`selfdraft.train.budget.plan_budget`
   then spends ``--budget-minutes`` on online features or on a feature cache of fewer conversations
   read for the epochs its kind is best trained for (the objective's ``budget_epochs``: EAGLE-3 3,
   as the recipe sweep found, the block kinds 8), where the disk allows: that plan fixes
   the data and the cache, written first. The run then trains against the budget left
   (``train.time_budget_minutes``): it re-plans its number of steps from the step times it measures,
   so a machine that was busy while the calibration was timed does not leave the budget half spent.
   ``stages.json`` records the plan, the seconds spent on the cache and on optimizer steps, and the
   steps taken.
2. **bench** it against the vanilla baseline (our loop without a drafter), prompt lookup, copy
   drafting, the hybrid of copying and the drafter (``hybrid:DRAFTER``, inference/hybrid.py) and
   transformers' greedy and prompt-lookup decoding on a subset of MT-bench and HumanEval, greedy
   (token identity is checked), and print the table, where the report is, and the fastest exact
   configuration measured on this machine with the command that decodes with it.
3. **export** it in every engine layout its kind has (``OUT/export-vllm``, ``OUT/export-sglang``;
   SGLang serves DFlash only through the target's own LM head, so a DFlash drafter with a reduced draft
   vocabulary gets no SGLang folder, and vLLM captures the target's hidden states only from some
   families (heads/vllm_targets.py), so a ``--target`` of another family gets no vLLM folder: the stage
   says why), each with a README.md model card holding the measured acceptance length and its serving
   command, next to the native one.

``--target`` (:attr:`QuickstartConfig.target`) trains for, benches and exports for another target than
the preset's: any family the decoder serves (docs/families.md); one it refuses stops the run at its
first load with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import time
from dataclasses import dataclass

from selfdraft.errors import SelfdraftError
from selfdraft.train.deadline import StepTimer, stopwatch

BENCH_METHODS = ("none", "prompt-lookup", "copy", "hf-greedy", "hf-prompt-lookup")
"""Run beside the trained drafter and its hybrid with copying (``hybrid:DRAFTER``)."""
EXPORT_FORMATS = ("vllm", "sglang")


@dataclass(frozen=True)
class QuickstartConfig:
    out: str = "quickstart"
    """Folder for the run, the export and the bench report."""
    budget_minutes: float = 15.0
    """Training time: writing the planned feature cache, then optimizer steps until the deadline
    (loading, evaluation and saving come on top)."""
    config: str = "quickstart"
    """The run preset or YAML file to train."""
    overrides: tuple[str, ...] = ()
    target: str | None = None
    """The target to train for and bench on (a built-in name, a local HF folder or a hub name): sets the run
    config's ``target.spec``, as ``--target`` does for ``selfdraft bench``; None: the preset's."""
    calibration_steps: int = 10
    """Online steps timed (in a run of their own, then discarded; their median after the first) before
    the budget is planned."""
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


def _times(speedup: float) -> str:
    text = f"{speedup:.2f}x"
    return f"{speedup:.3f}x" if speedup < 1.0 and text == "1.00x" else text


def verdict(results: dict, drafter: str) -> dict:
    """Whether the trained drafter pays for itself: its speedup over no drafter on each bench task, and
    where it does not (below 1.0x), the fastest method measured on that task."""
    from selfdraft.inference.bench.common import BASELINE

    tasks: dict[str, dict] = {}
    for row in results["rows"]:
        if row["temperature"] != 0:
            continue
        entry = tasks.setdefault(row["task"], {"drafter": None, "fastest": None})
        if row["method"] == drafter:
            entry["drafter"] = row["speedup"]
        fastest = entry["fastest"]
        if fastest is None or row["speedup"] > fastest[1]:
            entry["fastest"] = (row["method"], row["speedup"])
    pays = all(e["drafter"] is not None and e["drafter"] >= 1.0 for e in tasks.values())
    parts = []
    for task, e in tasks.items():
        if e["drafter"] is None:
            continue
        # Formatted from the measured value as the bench table formats it (rounding twice can disagree),
        # with a third digit where two would show a slowdown as 1.00x.
        text = f"{_times(e['drafter'])} on {task}"
        if e["drafter"] < 1.0:
            method, speedup = e["fastest"]
            name = "the trained drafter" if method == drafter else ("no drafter" if method == BASELINE else f"`{method}`")
            text += f" (slower than no drafter; fastest measured there: {name}, {_times(speedup)})"
        parts.append(text)
    summary = ("the trained drafter pays for itself: " if pays else
               "the trained drafter does NOT pay for itself on every task (more training, a GPU or bf16 hardware "
               "helps; see README): ") + ", ".join(parts)
    best = fastest_exact(results)
    if best is not None:
        summary += (f"; fastest exact configuration here: `{best['method']}` ({_times(best['speedup'])} geometric mean; "
                    + ", ".join(f"{_times(v)} on {t}" for t, v in best["tasks"].items())
                    + f"): selfdraft generate --drafter {best['method']}")
    tasks = {task: {"drafter": None if e["drafter"] is None else round(e["drafter"], 3),
                    "fastest": (e["fastest"][0], round(e["fastest"][1], 3))} for task, e in tasks.items()}
    return {"pays_for_itself": pays, "tasks": tasks, "summary": summary, "fastest_exact": best}


def fastest_exact(results: dict) -> dict | None:
    """The method of our own loop (no ``hf-``/``vllm`` row) with the highest geometric mean speedup over
    every greedy task, among those whose output was token-identical on every task; None without one."""
    by_method: dict[str, dict[str, float]] = {}
    excluded, tasks = set(), set()
    for row in results["rows"]:
        if row["temperature"] != 0:
            continue
        tasks.add(row["task"])
        if row["method"].startswith(("hf-", "vllm")) or not row.get("exact", True):
            excluded.add(row["method"])
        by_method.setdefault(row["method"], {})[row["task"]] = row["speedup"]
    scored = [(math.prod(speedups.values()) ** (1 / len(speedups)), method, speedups)
              for method, speedups in by_method.items() if method not in excluded and set(speedups) == tasks]
    if not scored:
        return None
    mean, method, speedups = max(scored, key=lambda s: s[0])
    return {"method": method, "speedup": mean, "tasks": dict(sorted(speedups.items()))}


def _append_learning_curve(report: pathlib.Path, run_dir: pathlib.Path) -> None:
    """Add the training run's held-out learning curve (table and plot) to the bench report."""
    from selfdraft.train.plots import learning_curve_table

    metrics = run_dir / "metrics.jsonl"
    table = learning_curve_table(metrics) if metrics.is_file() else ""
    if not table or not report.is_file():
        return
    plot = run_dir / "training.png"
    link = f"\n\n![training curves]({os.path.relpath(plot, report.parent)})" if plot.is_file() else ""
    text = report.read_text(encoding="utf-8").rstrip("\n")
    report.write_text(f"{text}\n\n## The drafter's learning curve\n\nHeld-out top-1 accuracy by draft depth during "
                      f"training, and the acceptance length it predicts for the exported tree (compare with the measured "
                      f"tau above):\n\n{table}{link}\n", encoding="utf-8")


def _device(name: str) -> str:
    """``auto`` -> cuda where there is a GPU, else cpu. Training goes through accelerate, which takes a
    GPU where there is one: ``cpu`` is passed on to it (``train(cpu=True)``)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SelfdraftError("--device cuda asked for, but CUDA is not available here; use --device cpu")
    if name not in ("cpu", "cuda"):
        raise SelfdraftError(f"--device must be auto, cpu or cuda, not {name!r}")
    return name


def _say(message: str) -> None:
    print(f"[quickstart] {message}", flush=True)


def _plan(qc: QuickstartConfig, config, overrides: list[str], out: pathlib.Path, qc_device: str,
          step_timer: StepTimer) -> dict:
    """Time ``calibration_steps`` online steps (in ``OUT/calibration``, then discarded) and spend the
    budget by :func:`selfdraft.train.budget.plan_budget`: online features or a feature cache, and how
    many conversations."""
    import torch

    from selfdraft.configs.run import load_run_config
    from selfdraft.heads.kinds import get_kind
    from selfdraft.heads.target import load_target_tokenizer, resolve_dtype
    from selfdraft.train.budget import StepCosts, free_gb, plan_budget
    from selfdraft.train.features import feature_layers
    from selfdraft.train.loop import train

    folder = out / "calibration"
    cps = config.train.micro_batch_size * config.train.grad_accum
    sample = min(config.data.max_conversations or 10**9, 10 * cps * qc.calibration_steps)  # enough to draw from
    calibration = load_run_config(qc.config, [*overrides, f"train.output_dir={folder}", "train.features=",
                                              "train.time_budget_minutes=0",
                                              f"train.save_every={qc.calibration_steps}", f"data.max_conversations={sample}"])
    _say(f"train: {config.name}, timing {qc.calibration_steps} steps to plan {qc.budget_minutes:g} minutes")
    shutil.rmtree(folder, ignore_errors=True)  # an interrupted calibration starts over: its steps are timed
    first = train(calibration, stop_after=qc.calibration_steps, cpu=qc_device == "cpu", step_timer=step_timer)
    shutil.rmtree(folder, ignore_errors=True)
    costs = StepCosts.measured(first, cps)
    _, identity = load_target_tokenizer(config.target.spec, trust_remote_code=config.target.trust_remote_code)
    layers = feature_layers(config, identity.num_layers)
    itemsize = torch.empty((), dtype=resolve_dtype(config.target.dtype, qc_device)).element_size()  # the cache keeps it
    available = config.data.max_conversations or 10**9
    objective = get_kind(config.drafter.kind).objective_class()  # how many epochs its kind is best trained for
    plan = plan_budget(qc.budget_minutes * 60, costs, available=available,
                       bytes_per_token=len(layers) * identity.hidden_size * itemsize, free_gb=free_gb(out),
                       epochs=objective.budget_epochs, evidence=objective.budget_evidence)
    _say(f"train: {costs.seconds_per_step:.2f} s per step ({costs.target_seconds_per_step:.2f} s of it the target's "
         f"forward) -> {plan.steps} steps: {plan.reason}")
    return dataclasses.asdict(plan)


def _train_stage(qc: QuickstartConfig, overrides: list[str], out: pathlib.Path, stages: _Stages, device: str,
                 step_timer: StepTimer = stopwatch) -> None:
    """Stage 1: plan (once), write the planned cache, train against the budget left; records the stage."""
    from selfdraft.configs.run import load_run_config
    from selfdraft.heads.target import load_target_tokenizer
    from selfdraft.train import checkpoint as ckpt
    from selfdraft.train.budget import resolve_features
    from selfdraft.train.data import conversations_for
    from selfdraft.train.loop import train

    config = load_run_config(qc.config, overrides)
    run_dir = pathlib.Path(config.train.output_dir)
    plan = stages.data.get("plan")
    if plan is None:
        plan = _plan(qc, config, overrides, out, device, step_timer)
        stages.data["plan"] = plan
        stages.save()
    # The plan counts conversations the run trains on: the held-out share of data.max_conversations comes
    # on top, and those with no assistant token within max_length are dropped when rendering, so
    # data.max_conversations asks for as many as render that many.
    held = 0.0 if config.data.eval_source else config.data.eval_fraction
    cps = config.train.micro_batch_size * config.train.grad_accum
    usable = max(4 * cps, math.ceil(plan["conversations"] / (1 - held)))
    tokenizer, _ = load_target_tokenizer(config.target.spec, trust_remote_code=config.target.trust_remote_code)
    wanted = min(config.data.max_conversations or 10**9, conversations_for(config.data, tokenizer, usable) or 10**9)
    # A held-out evaluation about every quarter of the planned run: the learning curve the report shows.
    config = load_run_config(qc.config, [*overrides, f"data.max_conversations={wanted}", f"train.max_steps={plan['steps']}",
                                         f"train.features={'auto' if plan['features'] == 'cached' else ''}",
                                         f"train.eval_every={max(1, plan['steps'] // 4)}"])
    # The cache's writing is part of the budget (the plan counted it): timed here, summed over the attempts
    # that got past it (one interrupted while writing is not counted).
    began = time.perf_counter()
    config = resolve_features(config, min_epochs=0.0, cpu=device == "cpu")  # the plan has decided; writes or finds it
    cache_seconds = stages.data.get("cache_seconds", 0.0) + (time.perf_counter() - began if plan["features"] == "cached" else 0.0)
    stages.data["cache_seconds"] = cache_seconds
    stages.save()
    budget = qc.budget_minutes * 60
    left = max(budget - cache_seconds, 0.01 * budget)  # positive: the run takes a step before its deadline ends it
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, time_budget_minutes=left / 60))
    result = train(config, resume=ckpt.latest_checkpoint(run_dir / "checkpoints") is not None, cpu=device == "cpu",
                   step_timer=step_timer)
    if result.drafter_dir is None:
        raise SelfdraftError(f"training stopped at step {result.step} of {plan['steps']} planned; rerun to resume")
    stages.finish("train", {"steps": result.step, "planned_steps": plan["steps"], "budget_seconds": budget,
                            "train_seconds": round(result.run_train_seconds, 3), "cache_seconds": round(cache_seconds, 3),
                            "drafter": str(result.drafter_dir), "last_eval": result.last_eval})
    _say(f"train: done, {result.step} steps in {result.run_train_seconds / 60:.1f} minutes of training "
         f"(planned first: {plan['steps']}), drafter in {result.drafter_dir}")


def quickstart(qc: QuickstartConfig) -> dict:
    """Run (or resume) the quickstart; returns the bench results. See the module docstring."""
    from selfdraft.configs.run import load_run_config

    if qc.budget_minutes <= 0:
        raise SelfdraftError(f"--budget-minutes must be > 0, got {qc.budget_minutes}")
    device = _device(qc.device)
    out = pathlib.Path(qc.out)
    run_dir = out / "run"
    if qc.target and any(o.split("=", 1)[0].strip() == "target.spec" for o in qc.overrides):
        raise SelfdraftError("the target is given twice (--target and a target.spec= override): give it once")
    chosen = [f"target.spec={qc.target}"] if qc.target else []
    overrides = [*chosen, *qc.overrides, f"train.output_dir={run_dir}"]
    config = load_run_config(qc.config, overrides)
    if qc.calibration_steps < 1:
        raise SelfdraftError(f"calibration_steps must be >= 1, got {qc.calibration_steps}")
    out.mkdir(parents=True, exist_ok=True)
    key = {"config": qc.config, "overrides": list(qc.overrides), "budget_minutes": qc.budget_minutes}
    if qc.target:  # absent otherwise: folders of earlier quickstarts keep their key
        key["target"] = qc.target
    stages = _Stages(out, key)
    began = time.perf_counter()

    # 1. train
    if stages.done("train"):
        _say(f"train: done before ({stages.done('train')['steps']} steps), skipped")
    else:
        _train_stage(qc, overrides, out, stages, device)
    drafter = pathlib.Path(stages.done("train")["drafter"])

    # 2. bench
    if stages.done("bench"):
        _say(f"bench: done before, report at {stages.done('bench')['report']}, skipped")
        results = json.loads((out / "bench" / "results.json").read_text(encoding="utf-8"))
    else:
        from selfdraft.inference.bench import run_bench

        _say(f"bench: {qc.bench_tasks}, {qc.bench_limit} prompts each, {qc.max_new_tokens} new tokens, greedy")
        results = run_bench(config.target.spec, [*BENCH_METHODS, str(drafter), f"hybrid:{drafter}"], qc.bench_tasks, [0.0],
                            qc.max_new_tokens, qc.bench_limit, out / "bench", dtype=config.target.dtype,
                            device=device, threads=qc.threads, command="selfdraft quickstart")
        _append_learning_curve(out / "bench" / "report.md", run_dir)
        stages.finish("bench", {"report": str(out / "bench" / "report.md"), "verdict": verdict(results, str(drafter))})
    _say(f"bench: {verdict(results, str(drafter))['summary']}")

    # 3. export, with the acceptance length the bench measured in each model card
    if stages.done("export"):
        _say(f"export: done before ({', '.join(stages.done('export')['folders'].values())}), skipped")
    else:
        from selfdraft.train.export import export

        from selfdraft.heads.io import read_record
        from selfdraft.heads.kinds import get_kind

        acceptance = measured_acceptance(results, str(drafter))
        kind = get_kind(read_record(drafter).kind)
        folders = {}
        for fmt in EXPORT_FORMATS:  # each folder has a README.md with the command that serves it
            if fmt not in {w.format for w in kind.writers}:
                _say(f"export: {kind.title} drafters have no {fmt} layout (README's engine table says why); skipped")
                continue
            try:
                folder, message = export(drafter, fmt, out / f"export-{fmt}", acceptance=acceptance)
            except SelfdraftError as e:  # a layout this drafter or its target's family cannot take (refused before
                _say(f"export: no {fmt} folder: {e}")  # anything is written), e.g. a target vLLM does not capture
                continue
            folders[fmt] = str(folder)
            _say(f"export: {message}")
        stages.finish("export", {"folders": folders})
    _say(f"finished in {(time.perf_counter() - began) / 60:.1f} minutes this time")
    return results
