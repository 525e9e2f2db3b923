"""A time budget is a deadline: the run re-plans its steps from the step times it measures, fills the
budget when the first plan was too small, stops by it when steps are slower than planned, and resumes
exactly (the plan is in the checkpoint). Step times are scripted, so the tests are fast and exact."""

import json

import pytest
import torch

from selfdraft.configs.run import load_run_config
from selfdraft.errors import SelfdraftError
from selfdraft.train import checkpoint as ckpt
from selfdraft.train.deadline import MIN_MEASURED, StepPlan
from selfdraft.train.loop import lr_factor, train


class ScriptedTimer:
    """A step timer whose step k (0-based, counted over every run it times) takes ``seconds(k)``."""

    def __init__(self, seconds, first: int = 0):
        self.seconds, self.steps = seconds, first

    def __call__(self):
        took = float(self.seconds(self.steps))
        self.steps += 1
        return lambda: took


def _run_plan(plan: StepPlan, seconds, done: int = 0) -> int:
    while done < plan.total:
        done += 1
        plan.record(done, seconds(done - 1))
    return done


def test_without_a_budget_the_plan_is_max_steps():
    plan = StepPlan.for_run(8, None)
    assert _run_plan(plan, lambda k: 100.0) == 8 and plan.spent_seconds == 800
    assert StepPlan.for_run(8, 0).budget_seconds is None  # 0 is off
    # Resumed without a budget, max_steps wins over the saved total (a run may be extended).
    assert StepPlan.for_run(12, None, {"total": 8, "spent_seconds": 5.0}).total == 12


def test_a_plan_from_slow_calibration_grows_to_fill_the_budget():
    plan = StepPlan.for_run(4, 1.0)  # planned from 15 s steps; they take 5 s
    assert _run_plan(plan, lambda k: 5.0) == 12 and plan.spent_seconds == 60.0


def test_steps_slower_than_planned_stop_at_the_deadline():
    plan = StepPlan.for_run(20, 1.0)  # planned from 3 s steps; they take 10 s
    assert _run_plan(plan, lambda k: 10.0) == 6 and plan.spent_seconds == 60.0
    # Noisy steps: never more than one step's overshoot, never a step short of the budget's end.
    times = [4.0, 9.0, 5.0, 6.0, 5.5, 4.5, 7.0, 5.0, 6.5, 5.0] * 10
    plan = StepPlan.for_run(5, 2.0)
    done = _run_plan(plan, lambda k: times[k])
    assert 120 - max(times) < plan.spent_seconds <= 120 + max(times) and done == plan.total


def test_the_first_replan_waits_for_a_median_and_the_limit_caps_it():
    plan = StepPlan.for_run(100, 10.0)
    plan.record(1, 500.0)  # the first step's one-off costs alone would plan 1 more step
    assert plan.total == 100
    for done in range(2, MIN_MEASURED + 1):
        plan.record(done, 5.0)
    assert plan.total == MIN_MEASURED + int((600 - 500 - 5 * (MIN_MEASURED - 1)) // 5.0)
    capped = StepPlan.for_run(4, 1.0, limit=7)
    assert _run_plan(capped, lambda k: 1.0) == 7  # a feature cache that covers 7 steps
    assert StepPlan.for_run(10, 1.0, limit=7).total == 7


def test_a_saved_plan_continues_as_the_uninterrupted_one():
    times = [3.0, 5.0, 4.0, 6.0, 2.0, 5.0, 4.0, 3.5] * 10
    whole = StepPlan.for_run(5, 1.0)
    _run_plan(whole, lambda k: times[k])
    cut = StepPlan.for_run(5, 1.0)
    for done in range(1, 5):
        cut.record(done, times[done - 1])
    saved = json.loads(json.dumps(cut.state()))  # as state.json holds it
    resumed = StepPlan.for_run(5, 1.0, saved)
    _run_plan(resumed, lambda k: times[k], done=4)
    assert resumed.state() == whole.state()


# --- the training loop under a time budget, on the tiny target --------------------------------------


def _config(tiny_target, out, *more):
    return load_run_config("smoke_cpu", [
        f"target.spec={tiny_target}", f"train.output_dir={out}", "data.max_conversations=16", "data.max_length=64",
        "data.eval_fraction=0.2", "train.micro_batch_size=2", "train.grad_accum=1", "train.eval_every=0",
        "train.eval_batches=1", "train.save_every=0", "train.log_every=1", "train.warmup_steps=2", *more])


def _lrs(out):
    return [line["lr"] for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in line]


def test_a_run_fills_its_budget_when_the_first_plan_was_too_small(tiny_target, tmp_path):
    # Planned 3 steps (from a slow calibration); steps take 5 s: a minute holds 12.
    result = train(_config(tiny_target, tmp_path / "run", "train.max_steps=3", "train.time_budget_minutes=1"),
                   step_timer=ScriptedTimer(lambda k: 5.0))
    assert result.step == 12 and result.drafter_dir is not None
    assert result.run_train_seconds == result.train_seconds == 60.0 and result.step_seconds == [5.0] * 12
    state = ckpt.read_state(ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert state["step"] == 12 and state["plan"]["total"] == 12 and state["plan"]["spent_seconds"] == 60.0
    # The cosine was re-targeted to 12 steps when the plan grew (after step 3), and ends there.
    lrs = _lrs(tmp_path / "run")
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)
    assert lrs[5] == pytest.approx(1e-3 * lr_factor(6, 2, 12, 0.0))


def test_a_run_stops_at_the_deadline_when_steps_are_slower_than_planned(tiny_target, tmp_path):
    # Planned 20 steps; steps take 10 s: a minute holds 6, and the run finishes (evaluated, exported) there.
    result = train(_config(tiny_target, tmp_path / "run", "train.max_steps=20", "train.time_budget_minutes=1"),
                   step_timer=ScriptedTimer(lambda k: 10.0))
    assert result.step == 6 and result.drafter_dir is not None and result.run_train_seconds == 60.0
    assert "eval/predicted_tau" in result.last_eval


def test_a_budgeted_run_resumes_exactly(tiny_target, tmp_path):
    times = [3.0, 5.0, 4.0, 6.0, 2.0, 5.0, 4.0, 3.5] * 4

    def config(out):
        return _config(tiny_target, out, "train.max_steps=4", "train.time_budget_minutes=0.75", "train.save_every=3")

    whole = train(config(tmp_path / "whole"), step_timer=ScriptedTimer(lambda k: times[k]))
    cut = train(config(tmp_path / "cut"), stop_after=5, step_timer=ScriptedTimer(lambda k: times[k]))
    assert cut.drafter_dir is None and cut.step == 5
    resumed = train(config(tmp_path / "cut"), resume=True, step_timer=ScriptedTimer(lambda k: times[k], first=5))
    assert resumed.step == whole.step > 5 and resumed.run_train_seconds == whole.run_train_seconds <= 45
    a, b = whole.objective.trainable_state_dict(), resumed.objective.trainable_state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert _lrs(tmp_path / "cut") == _lrs(tmp_path / "whole")
    states = [ckpt.read_state(ckpt.latest_checkpoint(tmp_path / r / "checkpoints")) for r in ("whole", "cut")]
    assert states[0]["plan"] == states[1]["plan"]


def test_a_budgeted_run_plans_only_as_far_as_its_feature_cache_reaches(tiny_target, tmp_path):
    from selfdraft.train.features import write_features

    def config(out, *more):
        return _config(tiny_target, out, "data.max_conversations=24", *more)

    cache = tmp_path / "features"
    write_features(config(tmp_path / "run"), cache, steps=2)  # the examples of 2 steps, a few of the split's
    result = train(config(tmp_path / "run", "train.max_steps=1", "train.time_budget_minutes=1", f"train.features={cache}"),
                   step_timer=ScriptedTimer(lambda k: 1.0))
    assert 2 <= result.step < 60 and result.drafter_dir is not None
    with pytest.raises(SelfdraftError, match="not in"):  # a fixed number of steps must be covered whole
        train(config(tmp_path / "fixed", "train.max_steps=60", f"train.features={cache}"))
