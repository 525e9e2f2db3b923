"""The budget planner: online features or a cache, and how many conversations, from measured step
costs; ``train.features: auto`` makes that choice for a run before it starts."""

import pytest
import torch

from selfdraft.configs.run import load_run_config
from selfdraft.errors import SelfdraftError
from selfdraft.train.budget import StepCosts, plan_budget, resolve_features
from selfdraft.train.loop import train

# A step of 4 conversations: 2.4 s, 1.4 s of it the target's forward (about this CPU's EAGLE-3 step).
COSTS = StepCosts(seconds_per_step=2.4, target_seconds_per_step=1.4, conversations_per_step=4, tokens_per_conversation=450)
PER_TOKEN = 4 * 576 * 4  # EAGLE-3 on SmolLM2: four layers of 576 fp32 values


def test_a_cache_is_planned_for_the_sweeps_epochs_and_fills_the_budget():
    plan = plan_budget(1800, COSTS, available=4000, bytes_per_token=PER_TOKEN, free_gb=100, epochs=2)
    f, c = 1.4 / 4, 1.0 / 4
    assert plan.features == "cached" and plan.conversations == int(1800 / (f + 2 * c))
    assert plan.epochs == pytest.approx(2, abs=0.01)
    spent = plan.conversations * f + plan.steps * 1.0  # writing the cache + cached steps
    assert 1800 - 1.0 < spent <= 1800
    assert plan.cache_gb == pytest.approx(plan.conversations * 450 * PER_TOKEN / 1e9)
    assert "2 epochs" in plan.reason and "recipe sweep" in plan.reason


def test_one_epoch_or_a_full_disk_means_online_and_says_why():
    one = plan_budget(1800, COSTS, available=4000, bytes_per_token=PER_TOKEN, free_gb=100, epochs=1)
    assert (one.features, one.steps, one.conversations, one.cache_gb) == ("online", 750, 3000, 0.0)
    assert "cache pays only when" in one.reason
    full = plan_budget(1800, COSTS, available=4000, bytes_per_token=PER_TOKEN, free_gb=1.0, epochs=2)
    assert full.features == "online" and full.steps == 750 and "1.0 GB free" in full.reason
    capped = plan_budget(1800, COSTS, available=4000, bytes_per_token=PER_TOKEN, free_gb=100, epochs=2, max_gb=2)
    assert capped.features == "online" and "2 GB allowed" in capped.reason


def test_when_the_data_runs_out_online_the_cache_holds_all_of_it_for_more_epochs():
    plan = plan_budget(1800, COSTS, available=500, bytes_per_token=PER_TOKEN, free_gb=100, epochs=1)
    assert plan.features == "cached" and plan.conversations == 500
    assert plan.epochs == pytest.approx((1800 - 500 * 0.35) / (500 * 0.25), abs=0.05)  # about 13, not 6 online
    assert "runs out" in plan.reason
    with pytest.raises(SelfdraftError, match="plans nothing"):
        plan_budget(0, COSTS, available=500, bytes_per_token=PER_TOKEN, free_gb=100)


def test_costs_are_measured_from_the_steps_after_the_first():
    from selfdraft.train.loop import TrainResult

    result = TrainResult(output_dir=None, step=5, drafter_dir=None, last_eval={}, train_tokens_per_second=900.0,
                         train_seconds=15.0, step_seconds=[7.0, 2.0, 2.1, 1.9, 2.0], target_seconds=7.5)
    costs = StepCosts.measured(result, 4)
    assert costs.seconds_per_step == 2.0  # the first step's one-off costs left out
    assert costs.target_seconds_per_step == pytest.approx(1.0)  # the target's share (half) of the median step
    assert costs.tokens_per_conversation == pytest.approx(900 * 15 / 20)


def _config(tiny_target, out, *more):
    return load_run_config("smoke_cpu", ["drafter.kind=eagle3", 
        f"target.spec={tiny_target}", f"train.output_dir={out}", "data.max_conversations=12", "data.max_length=64",
        "data.eval_fraction=0.2", "train.micro_batch_size=2", "train.grad_accum=1", "train.eval_batches=2",
        "drafter.eagle.draft_vocab_size=512",
        "train.features=auto", *more])


def test_features_auto_caches_a_run_that_reads_its_data_again_and_trains_as_online(tiny_target, tmp_path, capsys):
    # 12 steps x 2 conversations of 12: two reads each, so a cache; the run equals the online one.
    cached = resolve_features(_config(tiny_target, tmp_path / "auto", "train.max_steps=12"))
    assert cached.train.features == str(tmp_path / "auto" / "features")
    assert (tmp_path / "auto" / "features" / "features.json").is_file()
    assert "12 steps read each of data.max_conversations=12 at least 2.0 times" in capsys.readouterr().out
    a = train(cached)
    b = train(_config(tiny_target, tmp_path / "online", "train.max_steps=12", "train.features="))
    sa, sb = a.objective.trainable_state_dict(), b.objective.trainable_state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert a.target_seconds == 0 < b.target_seconds < b.train_seconds  # what the cache saved, measured online
    # Resumed, the cache is found again (and not rewritten) whatever the step count now says.
    stamp = next((tmp_path / "auto" / "features" / "train").glob("shard-*")).stat().st_mtime_ns
    again = resolve_features(_config(tiny_target, tmp_path / "auto", "train.max_steps=2"))
    assert again.train.features == cached.train.features
    assert next((tmp_path / "auto" / "features" / "train").glob("shard-*")).stat().st_mtime_ns == stamp

    # 4 steps read 8 of 12 conversations: online, nothing written.
    online = resolve_features(_config(tiny_target, tmp_path / "short", "train.max_steps=4"))
    assert online.train.features == "" and not (tmp_path / "short").exists()
    assert "online target features (4 steps read 8 conversations of 12" in capsys.readouterr().out
    # A cache larger than allowed: online, with the size said, and nothing left behind.
    big = resolve_features(_config(tiny_target, tmp_path / "big", "train.max_steps=12"), max_gb=1e-6)
    assert big.train.features == "" and not (tmp_path / "big" / "features").exists()
    assert "the feature cache needs" in capsys.readouterr().out


def test_the_feature_source_is_a_typed_choice():
    from selfdraft.train.features import FeatureSource

    assert FeatureSource.parse("") == FeatureSource("online") and FeatureSource.parse(None).kind == "online"
    assert FeatureSource.parse("auto") == FeatureSource("auto")
    cache = FeatureSource.parse("runs/x/features")
    assert cache.kind == "cache" and str(cache.path) == "runs/x/features"
    for value in ("", "auto", "runs/x/features"):
        assert str(FeatureSource.parse(value)) == value


def test_train_decides_features_auto_itself(tiny_target, tmp_path, capsys):
    # train() from Python with train.features: auto, as the presets say: a cache here (each of 12
    # conversations read twice), written before the run, streamed by it, and named in its config.yaml.
    import yaml

    result = train(_config(tiny_target, tmp_path / "run", "drafter.kind=medusa", "train.max_steps=12"))
    assert "caching their features" in capsys.readouterr().out
    assert result.drafter_dir is not None and result.target_seconds == 0  # no target forward: streamed
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["features"] == str(tmp_path / "run" / "features")
