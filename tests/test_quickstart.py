"""``selfdraft quickstart`` end to end on a tiny random Llama: train within a budget, export, bench,
and a second run that reuses every stage."""

import json
import pathlib

import pytest

from selfdraft.cli import main
from selfdraft.errors import SelfdraftError


def _args(tiny_target, out):
    return ["quickstart", "--out", str(out), "--budget-minutes", "0.02", "--bench-limit", "1", "--max-new-tokens", "6",
            f"target.spec={tiny_target}", "data.max_conversations=24", "data.max_length=64", "data.eval_fraction=0.2",
            "train.micro_batch_size=2", "drafter.eagle.draft_vocab_size=512", "train.eval_batches=1"]


def test_quickstart_runs_end_to_end_and_a_second_run_reuses_its_stages(tiny_target, tmp_path, capsys, monkeypatch):
    # README's spelling: --out quickstart, a relative folder named like the preset the run reloads.
    monkeypatch.chdir(tmp_path)
    out = pathlib.Path("quickstart")
    assert main(_args(tiny_target, out)) == 0
    first = capsys.readouterr().out
    stages = json.loads((out / "stages.json").read_text())
    assert set(stages["done"]) == {"train", "export", "bench"} and stages["planned_steps"] >= 6
    assert "s per step ->" in first and "report:" in first
    assert (out / "run" / "drafter" / "config.json").is_file()
    for fmt, key in (("vllm", "eagle_aux_hidden_state_layer_ids"), ("sglang", "eagle_config")):
        engine = json.loads((out / f"export-{fmt}" / "config.json").read_text())
        assert engine["architectures"] == ["LlamaForCausalLMEagle3"] and key in engine
        card = (out / f"export-{fmt}" / "README.md").read_text()
        assert "held-out top-1 by depth" in card and ("vllm serve" if fmt == "vllm" else "sglang.launch_server") in card
        assert "| acceptance length | 1." in card  # measured by the bench stage, which runs first
    results = json.loads((out / "bench" / "results.json").read_text())
    methods = {row["method"] for row in results["rows"]}
    assert {"none", "prompt-lookup", "hf-greedy", "hf-prompt-lookup", str(out / "run" / "drafter")} <= methods
    assert {row["task"] for row in results["rows"]} == {"mt_bench", "humaneval"}
    assert all(row["exact"] for row in results["rows"] if row["method"] != "hf-prompt-lookup")
    assert (out / "bench" / "report.md").is_file()

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
