"""Training every drafter kind on a bf16 target, with and without bf16 autocast (accelerate's
``mixed_precision``), and on an fp32 target under autocast: three steps through the one loop, a finite
loss every step, the drafter's fp32 master weights moved, the target's weights bit-identical after."""

import json
import math

import pytest
import torch

from selfdraft.configs.run import load_run_config
from selfdraft.train import objectives
from selfdraft.train.loop import train

DRAFTERS = {
    "medusa-shared-target": [],
    "medusa-shared-data": ["drafter.medusa.labels=data"],
    "medusa-own-target": ["drafter.medusa.own_lm_head=true"],
    "medusa-own-data": ["drafter.medusa.own_lm_head=true", "drafter.medusa.labels=data"],
    "medusa2-lora": ["drafter.medusa.lora.rank=4"],
    "eagle": ["drafter.kind=eagle"],
    "eagle3": ["drafter.kind=eagle3", "drafter.eagle.draft_vocab_size=512"],
}
PRECISIONS = {
    "bf16-target": ["target.dtype=bfloat16", "train.mixed_precision=no"],
    "bf16-target-autocast": ["target.dtype=bfloat16", "train.mixed_precision=bf16"],
    "fp32-target-autocast": ["target.dtype=float32", "train.mixed_precision=bf16"],
}
# Every drafter on a bf16 target; under autocast, one of each loss path (a frozen bf16 LM head, the
# drafter's own fp32 heads, cross-entropy and KL, LoRA, EAGLE-1 and EAGLE-3), to keep the time down
# (bf16 on a CPU builds a kernel for each new shape: about 8 s a run here).
CASES = [*((d, "bf16-target") for d in DRAFTERS),
         *((d, "bf16-target-autocast") for d in ("medusa-own-data", "medusa2-lora", "eagle", "eagle3")),
         *((d, "fp32-target-autocast") for d in ("medusa-shared-target", "eagle3"))]


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state: a run with another mixed_precision needs it reset."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


FAST = {("medusa-shared-target", "bf16-target"), ("eagle3", "bf16-target-autocast")}
"""The cases the fast tier (``-m "not slow"``) runs: a Medusa run on a bf16 target, an EAGLE-3 one under autocast."""


@pytest.mark.parametrize(("drafter", "precision"), [
    pytest.param(d, p, id=f"{d}-{p}", marks=() if (d, p) in FAST else pytest.mark.slow) for d, p in CASES])
def test_every_drafter_trains_on_a_bf16_target(tiny_target, tmp_path, monkeypatch, drafter, precision):
    built = {}

    def build_and_keep(config, target_model, train_data=None):  # the weights as the run starts
        objective = build(config, target_model, train_data)
        built["drafter"] = {n: p.detach().clone() for n, p in objective.trainable_state_dict().items()}
        built["target"] = {n: p.detach().clone() for n, p in objective.target.named_parameters() if "lora_" not in n}
        return objective

    build = objectives.build_objective
    monkeypatch.setattr(objectives, "build_objective", build_and_keep)
    config = load_run_config("smoke_cpu", [
        f"target.spec={tiny_target}", f"train.output_dir={tmp_path / 'run'}", "data.max_conversations=12",
        "data.max_length=64", "data.eval_fraction=0.25", "train.micro_batch_size=2", "train.grad_accum=1",
        "train.max_steps=3", "train.eval_every=3", "train.eval_batches=1", "train.save_every=3", "train.log_every=1",
        *DRAFTERS[drafter], *PRECISIONS[precision]])
    result = train(config)
    from accelerate.state import AcceleratorState

    assert AcceleratorState().mixed_precision == config.train.mixed_precision
    objective = result.objective
    target_dtype = torch.bfloat16 if config.target.dtype == "bfloat16" else torch.float32
    assert {p.dtype for n, p in objective.target.named_parameters() if "lora_" not in n} == {target_dtype}

    losses = [json.loads(line).get("train/loss") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [x for x in losses if x is not None]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    # The drafter trains fp32 master weights, and they moved (Medusa-2: its LoRA weights too).
    trained = objective.trainable_state_dict()
    params = {n for n, p in objective.named_parameters() if p.requires_grad}
    assert params and all(trained[n].dtype == torch.float32 for n in params)
    moved = {n for n in params if not torch.equal(trained[n], built["drafter"][n])}
    assert moved == params, sorted(params - moved)[:5]
    # The target's own weights are bit-identical.
    after = {n: p.detach() for n, p in objective.target.named_parameters() if "lora_" not in n}
    assert after.keys() == built["target"].keys()
    assert all(torch.equal(after[n], built["target"][n]) for n in after)
    assert result.drafter_dir is not None and (result.drafter_dir / "model.safetensors").is_file()
