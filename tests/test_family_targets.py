"""`selfdraft bench --target FOLDER` and `selfdraft quickstart --target FOLDER` on a target of each family
that needed the decoder's per-layer-kind masks, caches and rollback (heads/target_layers.py): sliding
windows (mistral, gemma3_text, starcoder2, exaone4), soft-capping (gemma2, eager), attention sinks and
experts (gpt_oss, eager), gated linear attention (qwen3_next), short convolutions (lfm2) and latent
attention with experts (deepseek_v3). Each is a tiny random model over SmolLM2's vocabulary, saved as a
folder with SmolLM2's tokenizer (conftest.py ``family_folder``); the bench checks token identity itself
(every method against our loop without a drafter, transformers' ``generate()`` among them), and the
quickstart benches the drafter it trained the same way. A family the decoder refuses is refused at load
with one line that names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from selfdraft.cli import main

FAMILIES = ["mistral", "gemma3_text", "starcoder2", "exaone4", "gemma2", "gpt_oss", "qwen3_next", "lfm2", "deepseek_v3"]
"""The families that failed to decode before heads/target_layers.py."""
REFUSED = ["llama4_text", "bloom"]
"""Families the decoder refuses at load (TargetLayers.probe: their forwards under its masks and caches do not
reproduce the model's own; docs/families.md)."""


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_bench_on_the_family_is_token_identical(family, family_folder, tmp_path, capsys):
    folder = family_folder(family)
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(folder), "--methods", "none,prompt-lookup,hf-greedy", "--tasks", "mt_bench",
                 "--limit", "2", "--max-new-tokens", "8", "--threads", "1", "--no-plots", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert [r["method"] for r in rows] == ["none", "prompt-lookup", "hf-greedy"]
    assert all(r["prompts"] == 2 and r["new_tokens"] > 0 for r in rows)
    # every method's tokens equal our loop's without a drafter, which equal transformers' generate()'s
    assert all(r["exact"] for r in rows), [(r["method"], r["mismatches"]) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_quickstart_on_the_family_trains_benches_and_exports(family, family_folder, tmp_path, capsys):
    from selfdraft.heads.vllm_targets import VLLM_AUX_CAPTURE

    folder = family_folder(family)
    out = tmp_path / "qs"
    # The smallest run the quickstart plans: a few seconds of steps on 12 short conversations, one prompt.
    code = main(["quickstart", "--target", str(folder), "--out", str(out), "--device", "cpu", "--budget-minutes", "0.05",
                 "--bench-tasks", "mt_bench", "--bench-limit", "1", "--max-new-tokens", "4", "--threads", "1",
                 "data.max_conversations=12", "data.max_length=64", "data.eval_fraction=0.2", "train.micro_batch_size=2",
                 "drafter.block.draft_vocab_size=512", "drafter.block.anchors=8", "train.eval_batches=1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    stages = json.loads((out / "stages.json").read_text())
    assert set(stages["done"]) == {"train", "bench", "export"} and stages["key"]["target"] == str(folder)
    drafter = out / "run" / "drafter"
    record = json.loads((drafter / "config.json").read_text())
    assert record["target"]["name"] == str(folder) and record["kind"] == "dflash"
    results = json.loads((out / "bench" / "results.json").read_text())
    methods = {r["method"] for r in results["rows"]}
    assert {"none", "prompt-lookup", "copy", "hf-greedy", str(drafter), f"hybrid:{drafter}"} <= methods
    assert all(r["exact"] for r in results["rows"]), [(r["method"], r["mismatches"]) for r in results["rows"]]
    architecture = record["target"]["architecture"]
    if architecture in VLLM_AUX_CAPTURE:  # vLLM captures this family's hidden states: a DFlash folder for it
        engine = json.loads((out / "export-vllm" / "config.json").read_text())
        assert engine["architectures"] == ["DFlashDraftModel"]
    else:  # refused with the reason, and the quickstart still finishes
        assert not (out / "export-vllm").exists()
        assert f"no vllm folder: cannot export this dflash drafter for vLLM" in captured.out
        assert f"not {architecture}" in captured.out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3_text", "lfm2"])
def test_the_batched_verify_cost_is_measured_on_windowed_and_recurrent_targets(family, family_folder):
    """`selfdraft costs` and `bench --batch-sizes` time verify forwards and roll them back: with the
    decoder's cache (sliding layers keep every key) and recorded recurrent states."""
    from selfdraft.heads.target import load_target
    from selfdraft.inference.costs import measure_cost_surface

    target = load_target(str(family_folder(family)))
    surface = measure_cost_surface(target, [1, 2], [1, 4], context=24, reps=1)  # 24 > the window of 16
    assert all(t > 0 for row in surface.seconds for t in row)


@pytest.mark.slow
@pytest.mark.parametrize("family", REFUSED)
def test_a_family_the_decoder_refuses_is_one_line_naming_it(family, family_folder, tmp_path):
    folder = family_folder(family)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "selfdraft", "bench", "--target", str(folder), "--methods", "none",
                           "--tasks", "mt_bench", "--limit", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "b")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("selfdraft: error:")]
    assert len(errors) == 1 and family in errors[0] and "not supported" in errors[0], done.stderr[-2000:]
    assert not (tmp_path / "b" / "results.json").exists()
