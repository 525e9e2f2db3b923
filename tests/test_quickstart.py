"""``selfdraft quickstart`` end to end on a tiny random Llama: train within a budget, export, bench,
and a second run that reuses every stage."""

import json
import pathlib

import pytest

from selfdraft.cli import main
from selfdraft.errors import SelfdraftError
from selfdraft.quickstart import measured_acceptance


def _overrides(tiny_target):
    return [f"target.spec={tiny_target}", "data.max_conversations=12", "data.max_length=64", "data.eval_fraction=0.2",
            "train.micro_batch_size=2", "drafter.block.draft_vocab_size=512", "drafter.block.anchors=8",
            "train.eval_batches=1"]


def _args(tiny_target, out):
    # 15 s of steps on 12 conversations: more than one read of each, so the plan caches their features.
    return ["quickstart", "--out", str(out), "--budget-minutes", "0.25", "--bench-limit", "1", "--max-new-tokens", "6",
            *_overrides(tiny_target)]


def test_quickstart_runs_end_to_end_and_a_second_run_reuses_its_stages(tiny_target, tmp_path, capsys, monkeypatch):
    # README's spelling: --out quickstart, a relative folder named like the preset the run reloads.
    monkeypatch.chdir(tmp_path)
    out = pathlib.Path("quickstart")
    assert main(_args(tiny_target, out)) == 0
    first = capsys.readouterr().out
    stages = json.loads((out / "stages.json").read_text())
    assert set(stages["done"]) == {"train", "export", "bench"}
    plan = stages["plan"]
    assert plan["steps"] > 6 and plan["features"] == "cached" and plan["reason"] in first, plan
    assert "s per step (" in first and "report:" in first
    assert (out / "run" / "features" / "features.json").is_file() and "streaming the target's features" in first
    assert not (out / "calibration").exists()  # the timed steps are not kept
    assert (out / "run" / "drafter" / "config.json").is_file()
    # The preset's drafter, DFlash over a reduced vocabulary, is served by vLLM; SGLang drafts DFlash through the
    # target's own head only: the export stage says so and writes no SGLang folder.
    engine = json.loads((out / "export-vllm" / "config.json").read_text())
    assert engine["architectures"] == ["DFlashDraftModel"] and engine["dflash_config"]["target_layer_ids"], engine
    card = (out / "export-vllm" / "README.md").read_text()
    assert "held-out top-1 by" in card and "vllm serve" in card
    assert not (out / "export-sglang").exists() and "no sglang folder: SGLang drafts DFlash through" in first
    results = json.loads((out / "bench" / "results.json").read_text())
    # the card holds the acceptance length the bench stage (which runs first) measured for this drafter
    measured = measured_acceptance(results, str(out / "run" / "drafter"))
    assert measured is not None and measured["acceptance_length"] >= 1.0
    card = (out / "export-vllm" / "README.md").read_text()
    assert f"| acceptance length | {measured['acceptance_length']:.2f} (" in card
    methods = {row["method"] for row in results["rows"]}
    assert {"none", "prompt-lookup", "copy", "hf-greedy", "hf-prompt-lookup", str(out / "run" / "drafter"),
            f"hybrid:{out / 'run' / 'drafter'}"} <= methods
    assert {row["task"] for row in results["rows"]} == {"mt_bench", "humaneval"}
    assert all(row["exact"] for row in results["rows"] if row["method"] != "hf-prompt-lookup")
    assert (out / "bench" / "report.md").is_file()
    report = (out / "bench" / "report.md").read_text()
    assert "## The drafter's learning curve" in report and "predicted tau" in report and "training.png" in report
    judged = stages["done"]["bench"]["verdict"]
    assert judged["summary"] in first and set(judged["tasks"]) == {"mt_bench", "humaneval"}
    assert judged["fastest_exact"]["method"] in methods and "fastest exact configuration here" in judged["summary"]

    stamps = {p: p.stat().st_mtime_ns for p in [out / "run" / "drafter" / "config.json", out / "bench" / "results.json",
                                                  out / "export-vllm" / "config.json"]}
    assert main(_args(tiny_target, out)) == 0
    second = capsys.readouterr().out
    assert second.count("skipped") == 3 and "s per step" not in second
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())


def test_quickstart_refuses_other_settings_in_the_same_folder(tiny_target, tmp_path):
    from selfdraft.quickstart import QuickstartConfig, _Stages

    _Stages(tmp_path, {"config": "quickstart", "overrides": [], "budget_minutes": 15.0}).save()
    with pytest.raises(SelfdraftError, match="other settings"):
        _Stages(tmp_path, {"config": "quickstart", "overrides": [], "budget_minutes": 5.0})
    assert main(["quickstart", "--out", str(tmp_path), "--budget-minutes", "0"]) == 2
    assert QuickstartConfig().config == "quickstart"


def test_the_verdict_names_the_fastest_method_where_the_drafter_does_not_pay():
    from selfdraft.quickstart import verdict

    def row(task, method, speedup, t=0.0):
        return {"task": task, "method": method, "speedup": speedup, "temperature": t}

    rows = [row("mt_bench", "none", 1.0), row("mt_bench", "run/drafter", 1.12), row("mt_bench", "prompt-lookup", 1.05),
            row("humaneval", "none", 1.0), row("humaneval", "run/drafter", 0.93), row("humaneval", "prompt-lookup", 2.1),
            row("humaneval", "run/drafter", 3.0, t=0.7)]  # other temperatures do not count
    judged = verdict({"rows": rows}, "run/drafter")
    assert not judged["pays_for_itself"]
    assert "1.12x on mt_bench" in judged["summary"]
    assert "0.93x on humaneval (slower than no drafter; fastest measured there: `prompt-lookup`, 2.10x)" in judged["summary"]
    slow = [dict(r, speedup=0.9) if r["method"] == "prompt-lookup" else r for r in rows]
    assert "fastest measured there: no drafter, 1.00x" in verdict({"rows": slow}, "run/drafter")["summary"]
    rows[4]["speedup"] = 1.0151  # formatted as the bench table formats it, not rounded twice
    judged = verdict({"rows": rows}, "run/drafter")
    assert judged["pays_for_itself"] and "1.02x on humaneval" in judged["summary"]
    rows[4]["speedup"] = 0.9987  # a slowdown never reads 1.00x
    assert "0.999x on humaneval (slower than no drafter" in verdict({"rows": rows}, "run/drafter")["summary"]


def test_the_verdict_names_the_fastest_exact_configuration_with_its_command():
    from selfdraft.quickstart import fastest_exact, verdict

    def row(task, method, speedup, exact=True, t=0.0):
        return {"task": task, "method": method, "speedup": speedup, "temperature": t, "exact": exact}

    rows = [row("mt_bench", "none", 1.0), row("humaneval", "none", 1.0),
            row("mt_bench", "run/drafter", 1.3), row("humaneval", "run/drafter", 1.2),
            row("mt_bench", "prompt-lookup", 1.1), row("humaneval", "prompt-lookup", 2.0),
            row("mt_bench", "hybrid:run/drafter", 1.4), row("humaneval", "hybrid:run/drafter", 2.1),
            row("mt_bench", "copy", 5.0, exact=False), row("humaneval", "copy", 5.0),  # not exact on one task
            row("mt_bench", "hf-greedy", 9.0), row("humaneval", "hf-greedy", 9.0),  # not our loop
            row("mt_bench", "fast-on-one-task", 9.0),  # not measured on every task
            row("mt_bench", "run/drafter", 9.0, t=0.7), row("humaneval", "run/drafter", 9.0, t=0.7)]
    best = fastest_exact({"rows": rows})
    assert best == {"method": "hybrid:run/drafter", "speedup": pytest.approx((1.4 * 2.1) ** 0.5),
                    "tasks": {"humaneval": 2.1, "mt_bench": 1.4}}
    summary = verdict({"rows": rows}, "run/drafter")["summary"]
    assert "fastest exact configuration here: `hybrid:run/drafter` (1.71x geometric mean; 2.10x on humaneval, " \
           "1.40x on mt_bench): selfdraft generate --drafter hybrid:run/drafter" in summary
    assert fastest_exact({"rows": [row("mt_bench", "copy", 2.0, exact=False)]}) is None


def test_a_busy_machine_during_calibration_still_fills_the_budget(tiny_target, tmp_path):
    """Calibration timed 20 s steps (the machine was busy); training steps take 7 s. The first plan is
    small, the run re-plans from its own step times and spends the budget (3 minutes) on steps:
    stages.json records the seconds and the steps."""
    from selfdraft.quickstart import QuickstartConfig, _Stages, _train_stage

    calibration = QuickstartConfig().calibration_steps
    calls = []

    def step_timer():  # scripted: the calibration's steps first, then the run's
        calls.append(None)
        took = 20.0 if len(calls) <= calibration else 7.0
        return lambda: took

    qc = QuickstartConfig(out=str(tmp_path), budget_minutes=3.0, overrides=tuple(_overrides(tiny_target)))
    stages = _Stages(tmp_path, {"config": qc.config, "overrides": list(qc.overrides), "budget_minutes": qc.budget_minutes})
    _train_stage(qc, [*qc.overrides, f"train.output_dir={tmp_path / 'run'}"], tmp_path, stages, "cpu", step_timer)
    recorded = json.loads((tmp_path / "stages.json").read_text())
    planned, done = recorded["plan"], recorded["done"]["train"]
    assert planned["steps"] <= 180 / 20 and done["planned_steps"] == planned["steps"]
    assert done["steps"] > planned["steps"] and done["steps"] == len(calls) - calibration
    assert done["train_seconds"] == pytest.approx(7.0 * done["steps"])
    assert 0.9 * 180 <= done["train_seconds"] + done["cache_seconds"] <= 180
    assert done["budget_seconds"] == 180 and (tmp_path / "run" / "drafter" / "config.json").is_file()
