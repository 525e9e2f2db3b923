"""The training stack on a tiny random Llama with SmolLM2's real tokenizer and chat template:
presets, a train step, exact resume, NaN stop, export from a run, DDP and DeepSpeed on CPU, Medusa-2."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import types

import pytest
import torch

from selfdraft.configs.run import load_run_config, presets
from selfdraft.errors import SelfdraftError
from selfdraft.heads.io import load_drafter, read_weights
from selfdraft.train import checkpoint as ckpt
from selfdraft.train.loop import TrainingDiverged, train

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny_config(tiny_target, out, *overrides):
    return load_run_config("smoke_cpu", [
        f"target.spec={tiny_target}", f"train.output_dir={out}", "data.max_conversations=24", "data.max_length=64",
        "data.eval_fraction=0.2", "train.micro_batch_size=2", "train.grad_accum=1", "train.max_steps=4",
        "train.eval_every=2", "train.eval_batches=2", "train.save_every=2", "train.log_every=1", *overrides])


def test_every_preset_loads_and_an_unknown_key_is_named():
    names = presets()
    assert {"smoke_cpu", "medusa_smollm2", "medusa2_smollm2"} <= set(names)
    for name, path in names.items():  # the values the file states (tests/test_configs.py checks every key)
        import yaml

        config = load_run_config(name)
        assert config.train.max_steps == yaml.safe_load(path.read_text())["train"]["max_steps"], name
    with pytest.raises(SelfdraftError, match=r"unknown config key train\.learning_rate"):
        load_run_config("smoke_cpu", ["train.learning_rate=1e-3"])
    with pytest.raises(SelfdraftError, match=r"drafter\.medusa\.num_heads"):
        load_run_config("smoke_cpu", ["drafter.medusa.num_heads=two"])
    with pytest.raises(SelfdraftError, match="unknown config key drafter.medusa.lora.rnak"):
        load_run_config("medusa2_smollm2", ["drafter.medusa.lora.rnak=4"])
    for accel in (REPO / "configs" / "accelerate").glob("*.yaml"):
        import yaml

        assert yaml.safe_load(accel.read_text())["distributed_type"] in {"MULTI_GPU", "DEEPSPEED", "FSDP"}


@pytest.fixture(scope="module")
def medusa_runs(tiny_target, tmp_path_factory):
    """own_lm_head -> (TrainResult, run folder) of ``tiny_config`` with that setting, trained once for the
    tests below that read a finished run and leave its folder as it is."""
    runs = {}

    def run(own_lm_head: bool):
        if own_lm_head not in runs:
            out = tmp_path_factory.mktemp("medusa-run") / "run"
            runs[own_lm_head] = train(tiny_config(tiny_target, out, f"drafter.medusa.own_lm_head={own_lm_head}")), out
        return runs[own_lm_head]

    return run


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_a_run_moves_the_heads_and_leaves_the_target_bit_identical(tiny_target, medusa_runs, own_lm_head):
    result, run = medusa_runs(own_lm_head)
    original = read_weights(tiny_target / "model.safetensors")
    trained = result.objective.target.state_dict()
    assert original and all(torch.equal(trained[name], tensor) for name, tensor in original.items())
    heads = result.objective.heads
    assert all(float(block[0].linear.weight.detach().abs().max()) > 0 for block in heads.blocks)  # moved from zero
    if own_lm_head:  # each head's projection starts as the target's LM head and trains on its own
        lm = original["model.embed_tokens.weight"]
        assert all(not torch.equal(head.weight.detach(), lm) for head in heads.lm_heads)
    # Run folder: resolved config, metrics, last two checkpoints, the export with a measured tree.
    assert (run / "config.yaml").is_file() and (run / "training.png").stat().st_size > 1000
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step-00000002", "step-00000004"]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/top1/head0" in line for line in lines) and any("train/loss" in line for line in lines)
    record = json.loads((run / "drafter" / "config.json").read_text())
    assert record["run_config"]["train"]["max_steps"] == 4
    assert len(record["decode"]["choices"]) == 8 and len(record["decode"]["rank_accuracy"]) == 3


def test_resume_continues_exactly(tiny_target, tmp_path):
    full = train(tiny_config(tiny_target, tmp_path / "full", "train.max_steps=6"))
    with pytest.raises(SelfdraftError, match="already holds checkpoints"):
        train(tiny_config(tiny_target, tmp_path / "full", "train.max_steps=6"))
    first = train(tiny_config(tiny_target, tmp_path / "cut", "train.max_steps=6"), stop_after=3)
    assert first.drafter_dir is None and ckpt.latest_checkpoint(tmp_path / "cut" / "checkpoints").name == "step-00000003"
    with pytest.raises(SelfdraftError, match="train.lr changed"):
        train(tiny_config(tiny_target, tmp_path / "cut", "train.max_steps=6", "train.lr=0.5"), resume=True)
    resumed = train(tiny_config(tiny_target, tmp_path / "cut", "train.max_steps=6"), resume=True)
    a, b = full.objective.trainable_state_dict(), resumed.objective.trainable_state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    steps = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and max(steps) == 6


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_target, tmp_path, monkeypatch):
    from selfdraft.heads.kinds.medusa.objective import MedusaObjective

    forward, calls = MedusaObjective.forward, []

    def poisoned(self, *args, **kwargs):  # the 3rd training batch gives a NaN loss
        loss, stats = forward(self, *args, **kwargs)
        calls.append(self.training)
        return (loss * float("nan") if sum(calls) == 3 and self.training else loss), stats

    monkeypatch.setattr(MedusaObjective, "forward", poisoned)
    config = tiny_config(tiny_target, tmp_path / "run", "train.save_every=1", "train.eval_every=0", "train.max_steps=6")
    with pytest.raises(TrainingDiverged, match="loss became nan at step 3") as info:
        train(config)
    kept = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in kept] == ["step-00000001", "step-00000002"] and str(kept[-1]) in str(info.value)
    state = ckpt.load_tree(kept[-1], "trainable")
    assert all(torch.isfinite(v).all() for v in state.values())


def test_export_from_a_run_and_from_an_interrupted_run(tiny_target, tmp_path):
    from selfdraft.cli import main
    from selfdraft.heads.kinds.medusa.formats import import_vllm_medusa

    train(tiny_config(tiny_target, tmp_path / "cut"), stop_after=2)
    assert main(["export", str(tmp_path / "cut"), "--format", "vllm", "--out", str(tmp_path / "vllm")]) == 0
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["num_heads"] == 3
    heads, lm_head = import_vllm_medusa(tmp_path / "vllm")
    drafter, _ = load_drafter(tmp_path / "cut" / "drafter")
    for k in range(3):
        torch.testing.assert_close(heads.blocks[k][0].linear.weight, drafter.blocks[k][0].linear.weight)
    assert main(["export", str(tmp_path / "cut"), "--format", "native", "--out", str(tmp_path / "native")]) == 0
    assert (tmp_path / "native" / "model.safetensors").is_file()
    assert main(["export", str(tmp_path / "nothing"), "--format", "vllm", "--out", str(tmp_path / "x")]) == 2


def test_trained_drafter_decodes_exactly_through_the_cli(tiny_target, medusa_runs, capsys):
    from selfdraft.cli import main

    _, run = medusa_runs(False)  # tiny_config as it is
    capsys.readouterr()
    runs = {}
    for drafter in ("none", str(run / "drafter")):
        assert main(["generate", "--target", str(tiny_target), "--drafter", drafter, "--prompt", "Tell me a story",
                     "--chat", "--max-new-tokens", "24", "--json"]) == 0
        runs[drafter] = json.loads(capsys.readouterr().out)
    assert runs[str(run / "drafter")]["token_ids"] == runs["none"]["token_ids"]
    assert main(["generate", "--target", str(tiny_target), "--drafter", str(run / "drafter"), "--prompt", "Hi",
                 "--max-nodes", "4", "--temperature", "0.8", "--seed", "1", "--typical-acceptance",
                 "--max-new-tokens", "8"]) == 0
    assert "LOSSY" in capsys.readouterr().err


def test_medusa2_trains_lora_and_exports_the_merged_target(tiny_target, tmp_path):
    from selfdraft.inference.api import generate
    from selfdraft.heads.target import load_target

    result = train(tiny_config(tiny_target, tmp_path / "run", "drafter.medusa.lora.rank=4", "train.max_steps=2"))
    lora = {n: p for n, p in result.objective.trainable_state_dict().items() if "lora_B" in n}
    assert lora and any(float(p.abs().max()) > 0 for p in lora.values())  # B starts at zero, then moves
    merged = tmp_path / "run" / "drafter-target"
    record = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert record["target"]["name"] == str(merged)
    target = load_target(str(merged))
    a = generate(target, "Hello there", chat=True, max_new_tokens=16)
    b = generate(target, "Hello there", chat=True, max_new_tokens=16, drafter=str(tmp_path / "run" / "drafter"))
    assert a.token_ids == b.token_ids


def _launch(args, env_extra, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **env_extra}
    accelerate = shutil.which("accelerate", path=str(pathlib.Path(sys.executable).parent))
    proc = subprocess.run([accelerate, "launch", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _overrides(tiny_target, out):
    return [f"target.spec={tiny_target}", f"train.output_dir={out}", "data.max_conversations=24", "data.max_length=64",
            "data.eval_fraction=0.2", "train.micro_batch_size=1", "train.grad_accum=1", "train.max_steps=3",
            "train.eval_every=0", "train.save_every=3", "train.num_threads=1"]


@pytest.mark.slow
def test_ddp_two_cpu_processes_equal_one_process_with_accumulation(tiny_target, tmp_path):
    """2 processes x 1 sequence with synchronised gradients = 1 process accumulating 2 sequences."""
    _launch(["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
             "--dynamo_backend", "no", "-m", "selfdraft.train", "--config", "smoke_cpu",
             *_overrides(tiny_target, tmp_path / "ddp")], {"ACCELERATE_USE_CPU": "true"}, tmp_path)
    state = ckpt.read_state(ckpt.latest_checkpoint(tmp_path / "ddp" / "checkpoints"))
    assert state["world_size"] == 2 and state["step"] == 3
    single = train(load_run_config("smoke_cpu", [*_overrides(tiny_target, tmp_path / "one"), "train.grad_accum=2"]))
    ddp = ckpt.load_tree(ckpt.latest_checkpoint(tmp_path / "ddp" / "checkpoints"), "trainable")
    for name, value in single.objective.trainable_state_dict().items():
        torch.testing.assert_close(ddp[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_two_nodes_render_their_own_data_and_equal_one_process(tiny_target, tmp_path):
    """Two machines of one process each (here both on this host: torchrun's two-node rendezvous on
    127.0.0.1), each with a node-local train.data_dir that its local main process renders: both folders
    hold the same split, and the run equals one process accumulating the same batches."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    accelerate = shutil.which("accelerate", path=str(pathlib.Path(sys.executable).parent))
    procs = [subprocess.Popen(
        [accelerate, "launch", "--multi_gpu", "--num_machines", "2", "--machine_rank", str(r), "--main_process_ip",
         "127.0.0.1", "--main_process_port", str(port), "--num_processes", "2", "--mixed_precision", "no",
         "--dynamo_backend", "no", "-m", "selfdraft.train", "--config", "smoke_cpu",
         *_overrides(tiny_target, tmp_path / "run"), f"train.data_dir={tmp_path / f'node{r}'}",
         "train.dist_timeout_minutes=5"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
    folders = [tmp_path / f"node{r}" for r in (0, 1)]
    assert all((f / "fingerprint.json").is_file() for f in folders) and not (tmp_path / "run" / "data").exists()
    assert (folders[0] / "fingerprint.json").read_text() == (folders[1] / "fingerprint.json").read_text()
    state = ckpt.read_state(ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert state["world_size"] == 2 and state["step"] == 3
    single = train(load_run_config("smoke_cpu", [*_overrides(tiny_target, tmp_path / "one"), "train.grad_accum=2",
                                                 "train.render_processes=2"]))
    two = ckpt.load_tree(ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints"), "trainable")
    for name, value in single.objective.trainable_state_dict().items():
        torch.testing.assert_close(two[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_deepspeed_zero2_on_cpu(tiny_target, tmp_path):
    _launch(["--config_file", str(REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"), "-m", "selfdraft.train",
             "--config", "smoke_cpu", *_overrides(tiny_target, tmp_path / "ds")], {}, tmp_path)
    state = ckpt.read_state(ckpt.latest_checkpoint(tmp_path / "ds" / "checkpoints"))
    assert state["world_size"] == 2 and state["sharded_optimizer"]
    drafter, record = load_drafter(tmp_path / "ds" / "drafter")
    single = train(load_run_config("smoke_cpu", [*_overrides(tiny_target, tmp_path / "one"), "train.grad_accum=2"]))
    for name, value in single.objective.heads.state_dict().items():
        torch.testing.assert_close(drafter.state_dict()[name], value, rtol=1e-4, atol=1e-5)
    # Resume the DeepSpeed run for two more steps: the same as resuming the single-process run.
    _launch(["--config_file", str(REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"), "-m", "selfdraft.train",
             "--config", "smoke_cpu", "--resume", *_overrides(tiny_target, tmp_path / "ds"), "train.max_steps=5"], {}, tmp_path)
    single = train(load_run_config("smoke_cpu", [*_overrides(tiny_target, tmp_path / "one"), "train.grad_accum=2",
                                                 "train.max_steps=5"]), resume=True)
    drafter, _ = load_drafter(tmp_path / "ds" / "drafter")
    for name, value in single.objective.heads.state_dict().items():
        torch.testing.assert_close(drafter.state_dict()[name], value, rtol=1e-4, atol=1e-5)


def _killed_when_a_checkpoint_appears(args, env_extra, cwd, ckpt_root):
    """Start ``accelerate launch ARGS`` and kill its whole process group (SIGKILL, as a crash or a
    preempted job would) as soon as a complete checkpoint exists; returns that checkpoint's step."""
    import signal
    import time

    import psutil

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **env_extra}
    accelerate = shutil.which("accelerate", path=str(pathlib.Path(sys.executable).parent))
    proc = subprocess.Popen([accelerate, "launch", *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while ckpt.latest_checkpoint(ckpt_root) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    running = proc.poll() is None
    # The launcher's workers may sit in sessions of their own: kill every descendant, then the launcher.
    for child in psutil.Process(proc.pid).children(recursive=True) if running else []:
        child.send_signal(signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    output = proc.communicate()[0]
    assert running, "the run ended before it could be killed:\n" + output[-4000:]
    return ckpt.read_state(ckpt.latest_checkpoint(ckpt_root))["step"]


@pytest.mark.slow
def test_more_processes_than_conversations_is_a_clear_error(tiny_target, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    accelerate = shutil.which("accelerate", path=str(pathlib.Path(sys.executable).parent))
    proc = subprocess.run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "selfdraft.train", "--config",
                           "smoke_cpu", *_overrides(tiny_target, tmp_path / "run"), "data.max_conversations=2",
                           "data.eval_fraction=0.5", "train.dist_timeout_minutes=2"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "2 processes x train.micro_batch_size 1 need at least 2 training conversations, the split has 1" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


SHARDED = {
    "zero3": ["--config_file", str(REPO / "configs" / "accelerate" / "deepspeed_zero3.yaml")],
    # The GPU config, on 2 CPU processes in fp32 (train/loop.py switches accelerate to FSDP2 over gloo).
    "fsdp": ["--config_file", str(REPO / "configs" / "accelerate" / "fsdp.yaml"), "--num_processes", "2",
             "--mixed_precision", "no"],
}


SHARDED_STEPS = 8
"""Steps of a sharded run: the kill lands at its first checkpoint (step 2, a checkpoint every 2 steps),
and the resumed run evaluates halfway and at the end."""


@pytest.fixture(scope="module")
def one_process_runs(tiny_target, tmp_path_factory):
    """The single-process reference of a sharded run: ``run(overrides)`` -> (TrainResult, run folder),
    trained once per distinct overrides and shared by the strategies that compare with it."""
    runs = {}

    def run(overrides):
        key = tuple(overrides)
        if key not in runs:
            out = tmp_path_factory.mktemp("one-process") / "one"
            runs[key] = train(load_run_config("smoke_cpu", [*_overrides(tiny_target, out), *overrides])), out
        return runs[key]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("strategy,kind,kill", [("zero3", "medusa", False), ("zero3", "medusa2", True), ("zero3", "eagle3", False),
                                                ("zero3", "dspark", True), ("fsdp", "medusa", False), ("fsdp", "eagle3", True),
                                                ("fsdp", "dflash", True)])
def test_sharded_training_equals_one_process_and_resumes_after_a_kill(tiny_target, tmp_path, one_process_runs, strategy,
                                                                    kind, kill):
    """DeepSpeed ZeRO-3 and FSDP2 on 2 CPU processes (gloo), the target sharded (ZeRO-3: created
    partitioned; FSDP: one unit per decoder layer, loaded by local rank 0 and broadcast in shards), every
    process running the same forwards (evaluation included, its last batch only partly real): the run
    equals one process accumulating the same batches (to float tolerance: 2 processes sum the gradients
    in another order), and (``kill``: two kinds per strategy, each launch costing ~10 s of start-up) a
    run killed with SIGKILL and resumed equals the uninterrupted run bit for bit."""
    config = [*SHARDED[strategy], "-m", "selfdraft.train", "--config", "smoke_cpu"]
    drafter = ["drafter.kind=medusa", "drafter.medusa.lora.rank=4"] if kind == "medusa2" else [f"drafter.kind={kind}"]
    if kind in ("dflash", "dspark"):  # every supervised position an anchor: the same blocks however the batches are split
        drafter += ["drafter.block.anchors=64", "drafter.block.block_size=4", "drafter.block.draft_vocab_size=512"]
    # 2 conversations a batch and 7 held out: the last evaluation batch holds one, filled up with an
    # unscored one so that both processes run the target as often (a ZeRO-3 gather per forward).
    run = [*drafter, f"train.max_steps={SHARDED_STEPS}", "train.save_every=2", f"train.eval_every={SHARDED_STEPS // 2}",
           "train.dist_timeout_minutes=5", "train.micro_batch_size=2", "data.eval_fraction=0.3", "train.eval_batches=0"]
    whole = _launch([*config, *_overrides(tiny_target, tmp_path / "whole"), *run], {}, tmp_path)
    if strategy == "zero3":
        assert "ZeRO-3 created the target partitioned: this process holds" in whole.stderr
    else:
        assert "FSDP2 over gloo" in whole.stderr
    a = ckpt.load_tree(ckpt.latest_checkpoint(tmp_path / "whole" / "checkpoints"), "trainable")
    killed = tmp_path / ("killed" if kill else "whole")
    if kill:
        step = _killed_when_a_checkpoint_appears([*config, *_overrides(tiny_target, killed), *run], {}, tmp_path,
                                                 killed / "checkpoints")
        assert 2 <= step < SHARDED_STEPS
        resumed = _launch([*config, "--resume", *_overrides(tiny_target, killed), *run], {}, tmp_path)
        assert "resuming from" in resumed.stdout + resumed.stderr
        b = ckpt.load_tree(ckpt.latest_checkpoint(killed / "checkpoints"), "trainable")
        assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a), f"killed at step {step}"
    assert (killed / "drafter").is_dir() and (kind != "medusa2" or (killed / "drafter-target").is_dir())
    single, one = one_process_runs([*run, "train.grad_accum=2"])
    for name, value in single.objective.trainable_state_dict().items():
        torch.testing.assert_close(a[name], value, rtol=1e-4, atol=1e-5)
    if kind == "medusa2":  # the LoRA-merged target, gathered from the shards, as one process writes it
        from safetensors.torch import load_file

        merged, reference = (load_file(d / "drafter-target" / "model.safetensors") for d in (killed, one))
        assert set(merged) == set(reference)
        for name in reference:
            torch.testing.assert_close(merged[name], reference[name], rtol=1e-4, atol=1e-5)


@pytest.mark.embedded
def test_distill_writes_resumable_shards_that_train_reads(embedded_fp32, tmp_path):
    from selfdraft.configs.schema import DataConfig
    from selfdraft.train.data import iter_conversations
    from selfdraft.train.distill import DistillConfig, distill

    target = embedded_fp32
    data = DataConfig(max_conversations=5)
    config = DistillConfig(max_new_tokens=6, batch_size=2, shard_size=2, max_turns=1)
    out = distill(target, data, tmp_path / "distilled", config)
    shards = sorted(out.glob("shard-*.jsonl"))
    assert [s.name for s in shards] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    conversations = list(iter_conversations(DataConfig(source=str(out))))
    originals = list(iter_conversations(data))
    assert len(conversations) == 5
    for new, old in zip(conversations, originals):
        old = old[next(i for i, m in enumerate(old) if m["role"] != "assistant"):]  # continuation chunks: no question
        assert new[-1]["role"] == "assistant" and [m["role"] for m in new][:-1] == [m["role"] for m in old][:len(new) - 1]
        assert new[0]["content"] == old[0]["content"]  # the prompt is kept, the answer regenerated
    # The answer is the target's own greedy continuation.
    from selfdraft.inference.api import generate

    prompt = target.tokenizer.apply_chat_template(conversations[0][:-1], tokenize=True, add_generation_prompt=True,
                                                  return_dict=False)
    expected = generate(target, input_ids=prompt, max_new_tokens=6)
    assert conversations[0][-1]["content"] == expected.text
    # A rerun skips finished shards (resume); other settings in the same folder are refused.
    shards[1].unlink()
    before = shards[0].stat().st_mtime_ns
    distill(target, data, out, config)
    assert shards[1].is_file() and shards[0].stat().st_mtime_ns == before
    with pytest.raises(SelfdraftError, match="other settings"):
        distill(target, data, out, DistillConfig(max_new_tokens=7, batch_size=2, shard_size=2))
    # The target in another dtype answers differently at near-ties: not resumed into the same folder.
    bf16 = types.SimpleNamespace(tokenizer=target.tokenizer, identity=target.identity,
                                 model=types.SimpleNamespace(dtype=torch.bfloat16))
    with pytest.raises(SelfdraftError, match=r"other settings \(target_dtype differ"):
        distill(bf16, data, out, config)


def test_wandb_offline_tracking(tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    train(tiny_config(tiny_target, tmp_path / "run", "train.report_to=wandb", "train.max_steps=2"))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())


def test_a_corrupt_checkpoint_is_a_clear_error_that_points_to_the_previous_one(tiny_target, tmp_path):
    config = tiny_config(tiny_target, tmp_path / "run", "train.save_every=1", "train.eval_every=0", "train.keep_last=3")
    train(config, stop_after=2)
    latest = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    weights = latest / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(SelfdraftError, match=r"truncated or corrupt.*--resume-from .*step-00000001"):
        train(config, resume=True)
    resumed = train(config, resume=tmp_path / "run" / "checkpoints" / "step-00000001")
    assert resumed.drafter_dir is not None


def test_ttt_mask_and_draft_vocabulary_by_hand():
    import numpy as np

    from selfdraft.heads.kinds.eagle.objective import ttt_mask as _ttt_mask
    from selfdraft.train.objectives import draft_vocabulary

    # L = 3 positions, step 1: query t sees step-0 keys s <= t-1 and its own step-1 key (s == t).
    visible = _ttt_mask(3, 1, torch.float32, "cpu")[0, 0] == 0
    assert visible.int().tolist() == [[0, 0, 0, 1, 0, 0],
                                      [1, 0, 0, 0, 1, 0],
                                      [1, 1, 0, 0, 0, 1]]
    # Step 2: step-0 keys s <= t-2, the step-1 key at t-1, the step-2 key at t.
    visible = _ttt_mask(3, 2, torch.float32, "cpu")[0, 0] == 0
    assert visible.int().tolist() == [[0, 0, 0, 0, 0, 0, 1, 0, 0],
                                      [0, 0, 0, 1, 0, 0, 0, 1, 0],
                                      [1, 0, 0, 0, 1, 0, 0, 0, 1]]
    data = [(np.array([5, 5, 3, 9, 3, 5]), np.array([0, 1, 1, 1, 1, 1])),  # counted: 5 x2, 3 x2, 9 x1
            (np.array([7, 9, 1]), np.array([1, 1, 0]))]                     # counted: 7, 9
    assert draft_vocabulary(data, 10, 3).tolist() == [3, 5, 9]  # 3, 5, 9 (x2 each); 7 loses the tie to 9
    assert draft_vocabulary(data, 10, 5).tolist() == [0, 3, 5, 7, 9]  # padded with the smallest unused id


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_runs_train_resume_export_and_decode_exactly(tiny_target, tmp_path, kind, capsys):
    from selfdraft.cli import main

    # drafter.tree: smoke_cpu's 8-node tree is its Medusa heads'; the EAGLE runs here keep the EAGLE presets' 4
    config = tiny_config(tiny_target, tmp_path / "full", f"drafter.kind={kind}", "drafter.eagle.draft_vocab_size=512",
                         "train.max_steps=5", "drafter.tree.max_nodes=4")
    full = train(config)
    original = read_weights(tiny_target / "model.safetensors")
    trained = full.objective.target.state_dict()
    assert all(torch.equal(trained[name], tensor) for name, tensor in original.items())
    fc = full.objective.drafter.fc.weight
    assert not torch.equal(fc.detach(), torch.zeros_like(fc))
    cut = tiny_config(tiny_target, tmp_path / "cut", f"drafter.kind={kind}", "drafter.eagle.draft_vocab_size=512",
                      "train.max_steps=5", "drafter.tree.max_nodes=4")
    train(cut, stop_after=3)
    resumed = train(cut, resume=True)
    a, b = full.objective.trainable_state_dict(), resumed.objective.trainable_state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    drafter, record = load_drafter(tmp_path / "full" / "drafter")
    assert record.kind == kind and record.decode["tree"]["max_nodes"] == 4
    if kind == "eagle3":
        assert drafter.lm_head.weight.shape[0] == 512 and int(drafter.t2d.sum()) == 512
    capsys.readouterr()
    runs = {}
    for spec in ("none", str(tmp_path / "full" / "drafter")):
        assert main(["generate", "--target", str(tiny_target), "--drafter", spec, "--prompt", "Tell me a story",
                     "--chat", "--max-new-tokens", "24", "--json"]) == 0
        runs[spec] = json.loads(capsys.readouterr().out)
    assert runs[str(tmp_path / "full" / "drafter")]["token_ids"] == runs["none"]["token_ids"]
    assert runs[str(tmp_path / "full" / "drafter")]["drafter"] == kind
    # Serving layout from the run folder; it decodes here as well (import of the same layout).
    assert main(["export", str(tmp_path / "full"), "--format", "sglang", "--out", str(tmp_path / "engine")]) == 0
    capsys.readouterr()
    assert main(["generate", "--target", str(tiny_target), "--drafter", str(tmp_path / "engine"), "--prompt", "Tell me a story",
                 "--chat", "--max-new-tokens", "24", "--json", "--tree-depth", "3", "--tree-top-k", "2", "--max-nodes", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == runs["none"]["token_ids"]


# ----------------------------------------------------------------------------------------------
# Precomputed target features


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_cached_features_give_the_same_batches_and_the_same_run(tiny_target, tmp_path, kind):
    from safetensors.torch import load_file

    from selfdraft.train.features import FeatureCache, open_feature_cache, target_features, write_features
    from selfdraft.train.loop import make_batch, prepare_data

    def config(out, *more):
        return tiny_config(tiny_target, out, f"drafter.kind={kind}", "drafter.eagle.draft_vocab_size=512",
                           "train.max_steps=3", *more)

    cache_dir = tmp_path / "features"
    # Interrupted after one shard, then resumed: the finished shard is kept, not rewritten.
    write_features(config(tmp_path / "cached"), cache_dir, shard_tokens=300, stop_after_shards=1)
    first = cache_dir / "train" / "shard-00000.safetensors"
    stamp = first.stat().st_mtime_ns
    with pytest.raises(SelfdraftError, match="unfinished"):
        train(config(tmp_path / "cached", f"train.features={cache_dir}"))
    write_features(config(tmp_path / "cached"), cache_dir, shard_tokens=300)
    assert first.stat().st_mtime_ns == stamp and len(list((cache_dir / "train").glob("shard-*"))) > 1
    assert load_file(first)["features"].dtype == torch.float32

    online = train(config(tmp_path / "online"))
    cached_config = config(tmp_path / "cached", f"train.features={cache_dir}")
    cached = train(cached_config)
    # The same batches: every train and eval example's cached features equal the online ones.
    from selfdraft.heads.target import load_target

    target = load_target(str(tiny_target))
    cache = open_feature_cache(cached_config, target, online.objective.feature_layers)
    from accelerate import Accelerator

    train_data, eval_data = prepare_data(cached_config, target.tokenizer, Accelerator(cpu=True))
    for split, data in (("train", train_data), ("eval", eval_data)):
        for start in range(0, len(data), 3):
            idx = list(range(start, min(start + 3, len(data))))
            batch = make_batch(data, idx, 0, "cpu", cache, split)
            want = target_features(target.model, batch["input_ids"], batch["attention_mask"], online.objective.feature_layers)
            assert torch.equal(batch["features"], want)
    # ... hence the same run: bit-identical drafter and metrics.
    a, b = online.objective.trainable_state_dict(), cached.objective.trainable_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    metrics = [(tmp_path / run / "metrics.jsonl").read_text().splitlines() for run in ("online", "cached")]
    strip = [[{k: v for k, v in json.loads(line).items() if k != "tokens_per_second"} for line in m] for m in metrics]
    assert strip[0] == strip[1]
    assert isinstance(cache, FeatureCache)


def test_feature_cache_size_is_planned_before_the_weights_load(tiny_target, tmp_path, monkeypatch, capsys):
    """Over the limit: the error comes before the target's weights are read, says to train online with
    that choice's compute cost, and offers bfloat16 only where the cache is not already 2 bytes a value."""
    import selfdraft.heads.target as target_module
    from selfdraft.train.features import write_features

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the size check")

    monkeypatch.setattr(target_module, "load_target", no_weights)
    config = tiny_config(tiny_target, tmp_path / "run")
    with pytest.raises(SelfdraftError) as err:
        write_features(config, tmp_path / "big", max_gb=1e-6)
    message = str(err.value)
    assert "Train with online features instead (leave train.features unset)" in message
    assert "TFLOP per epoch" in message and "store --dtype bfloat16" in message
    with pytest.raises(SelfdraftError) as err:
        write_features(config, tmp_path / "big", max_gb=1e-6, dtype="bfloat16")
    assert "online features" in str(err.value) and "--dtype bfloat16" not in str(err.value)
    assert f"for {tiny_target} (7 layers, hidden 32)" in capsys.readouterr().out
    assert not (tmp_path / "big").exists()


def test_feature_cache_errors_are_clear_and_write_nothing(tiny_target, tmp_path, capsys):
    from selfdraft.cli import main
    from selfdraft.train.features import write_features

    config = tiny_config(tiny_target, tmp_path / "run")
    with pytest.raises(SelfdraftError, match=r"needs 0\.\d+ GB, more than --max-gb 1e-06"):
        write_features(config, tmp_path / "small", max_gb=1e-6)
    assert not (tmp_path / "small").exists()
    capsys.readouterr()
    # The CLI prints the disk use before it starts; --steps caches only what 2 steps visit.
    assert main(["features", "--config", "smoke_cpu", "--out", str(tmp_path / "two"), "--steps", "2",
                 f"target.spec={tiny_target}", f"train.output_dir={tmp_path / 'run'}", "data.max_conversations=24",
                 "data.max_length=64", "data.eval_fraction=0.2", "train.micro_batch_size=2", "train.grad_accum=1"]) == 0
    out = capsys.readouterr().out
    assert "4 train + 2 eval conversations" in out and "GB (" in out and "train.features=" in out
    with pytest.raises(SelfdraftError, match=r"train examples this run visits are not in .*--steps"):
        train(tiny_config(tiny_target, tmp_path / "a", f"train.features={tmp_path / 'two'}"))
    with pytest.raises(SelfdraftError, match=r"other data \(data\.max_length differ"):
        train(tiny_config(tiny_target, tmp_path / "b", "data.max_length=48", f"train.features={tmp_path / 'two'}"))
    with pytest.raises(SelfdraftError, match=r"holds layers \[7\], this run needs \[2, 3, 4, 7\]"):
        train(tiny_config(tiny_target, tmp_path / "c", "drafter.kind=eagle3", f"train.features={tmp_path / 'two'}"))
    with pytest.raises(SelfdraftError, match="other settings"):
        write_features(config, tmp_path / "two", dtype="bfloat16")
    with pytest.raises(SelfdraftError, match="not a feature cache"):
        train(tiny_config(tiny_target, tmp_path / "d", f"train.features={tmp_path}"))
    with pytest.raises(SelfdraftError, match="Medusa-2 trains the target"):  # refused by its kind, before anything runs
        train(tiny_config(tiny_target, tmp_path / "e", "drafter.medusa.lora.rank=2", "train.features=x"))
    assert not (tmp_path / "e").exists()


def test_a_max_length_beyond_the_targets_context_is_refused_before_anything_is_written(tiny_target, tmp_path):
    from selfdraft.train.features import write_features

    # The tiny target's context is 512 positions.
    config = tiny_config(tiny_target, tmp_path / "run", "data.max_length=600")
    for run in (lambda: train(config), lambda: write_features(config, tmp_path / "features")):
        with pytest.raises(SelfdraftError, match=r"data.max_length 600 is longer than the target's context \(512 positions"):
            run()
    assert not (tmp_path / "features").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_mixed_precision_auto_follows_the_processor(tiny_target, tmp_path, monkeypatch):
    """``train.mixed_precision: auto`` (the presets): bf16 autocast only where the processor multiplies
    bf16 natively; every entry point that builds an accelerator takes it (a feature cache included)."""
    import selfdraft.machine as machine
    from selfdraft.train.features import write_features
    from selfdraft.train.loop import resolve_mixed_precision

    assert resolve_mixed_precision("no") == "no" and resolve_mixed_precision(None) is None
    if not torch.cuda.is_available():
        monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx2", "avx512f", "avx512_bf16"])
        assert resolve_mixed_precision("auto") == "bf16"
        monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx2"])
        assert resolve_mixed_precision("auto") == "no"
    config = tiny_config(tiny_target, tmp_path / "run", "train.mixed_precision=auto", "data.max_conversations=6")
    write_features(config, tmp_path / "features")
    assert (tmp_path / "features" / "features.json").is_file()
