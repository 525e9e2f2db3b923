"""dtype and precision defaults (issue 13): ``auto`` is bfloat16 on a GPU and float32 on a CPU;
train.mixed_precision unset takes accelerate's own setting and an explicit value wins, both logged;
distillation works with tokenizers that have no pad token (Llama-3.x)."""

import copy
import json

import pytest
import torch

from selfdraft.configs.run import load_run_config
from selfdraft.heads.target import resolve_dtype


def test_auto_is_float32_on_a_cpu_and_bfloat16_on_a_gpu(monkeypatch, capsys):
    assert resolve_dtype("auto") is torch.float32 and resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    # A GPU without bf16 (pre-Ampere): float16, said on stderr, not a crash inside the first matmul.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    assert resolve_dtype("auto", "cuda") is torch.float16 and resolve_dtype("bfloat16", "cuda:0") is torch.float16
    assert "Tesla T4 has no bfloat16: using float16" in capsys.readouterr().err
    assert resolve_dtype("float32", "cuda") is torch.float32
    assert load_run_config("smoke_cpu").target.dtype == "auto"
    assert load_run_config("smoke_cpu").train.mixed_precision is None


def _tiny(tiny_target, out, *overrides):
    return load_run_config("smoke_cpu", [
        f"target.spec={tiny_target}", f"train.output_dir={out}", "data.max_conversations=12", "data.max_length=48",
        "data.eval_fraction=0.2", "train.micro_batch_size=2", "train.grad_accum=1", "train.max_steps=1",
        "train.eval_every=0", "train.eval_batches=1", "train.save_every=0", *overrides])


def test_mixed_precision_comes_from_accelerate_unless_the_run_config_says(tiny_target, tmp_path, monkeypatch, capsys):
    from accelerate.state import AcceleratorState

    from selfdraft.train.loop import train

    def run(name, *overrides):
        AcceleratorState._reset_state(True)  # each run as its own process would start (accelerate's state is global)
        train(_tiny(tiny_target, tmp_path / name, *overrides))
        return capsys.readouterr().err

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert "mixed precision no (from accelerate's config)" in run("a")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch --mixed_precision bf16` sets
    assert "mixed precision bf16 (from accelerate's config)" in run("b")
    assert "mixed precision no (from train.mixed_precision)" in run("c", "train.mixed_precision=no")
    AcceleratorState._reset_state(True)


@pytest.mark.embedded
def test_distill_pads_with_eos_where_the_tokenizer_has_no_pad_token(embedded_fp32, tmp_path):
    from selfdraft.configs.schema import DataConfig
    from selfdraft.heads.target import Target
    from selfdraft.train.data import iter_conversations
    from selfdraft.train.distill import DistillConfig, distill

    tokenizer = copy.deepcopy(embedded_fp32.tokenizer)
    tokenizer.pad_token = None  # as Llama-3.x ships
    assert tokenizer.pad_token_id is None
    no_pad = Target(embedded_fp32.model, tokenizer, embedded_fp32.identity)
    data = DataConfig(max_conversations=3)
    config = DistillConfig(max_new_tokens=6, batch_size=3, shard_size=3, max_turns=1)  # one padded batch
    padded = distill(no_pad, data, tmp_path / "no-pad", config)
    assert tokenizer.pad_token is None  # the tokenizer is left as it was
    reference = distill(embedded_fp32, data, tmp_path / "pad", config)
    answers = [[m["content"] for m in c] for c in iter_conversations(DataConfig(source=str(padded)))]
    assert len(answers) == 3
    assert answers == [[m["content"] for m in c] for c in iter_conversations(DataConfig(source=str(reference)))]
    assert json.loads((padded / "distill.json").read_text())["distill"]["batch_size"] == 3



def test_collective_timeout_comes_from_the_run_config(monkeypatch, tmp_path):
    """train.dist_timeout_minutes reaches the process group of a launched run (gloo on a CPU)."""
    import datetime

    import accelerate

    from selfdraft.errors import SelfdraftError
    from selfdraft.train.loop import _make_accelerator

    seen = {}

    class Capture:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            self.is_main_process, self.mixed_precision, self.device = False, "no", "cpu"

    monkeypatch.setattr(accelerate, "Accelerator", Capture)
    monkeypatch.setenv("WORLD_SIZE", "2")
    _make_accelerator(load_run_config("smoke_cpu", ["train.dist_timeout_minutes=90"]), tmp_path)
    (handler,) = seen["kwargs_handlers"]
    assert handler.timeout == datetime.timedelta(minutes=90)
    assert handler.backend == ("nccl" if torch.cuda.is_available() else "gloo")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _make_accelerator(load_run_config("smoke_cpu"), tmp_path)
    assert seen["kwargs_handlers"] == []
    with pytest.raises(SelfdraftError, match="dist_timeout_minutes must be > 0"):
        load_run_config("smoke_cpu", ["train.dist_timeout_minutes=0"])
