"""Peak resident memory per process: one process against DeepSpeed ZeRO-2 and ZeRO-3.

    python scripts/bench_zero3_memory.py                 # a random Llama of about 1 GB (fp32)
    python scripts/bench_zero3_memory.py --layers 4      # smaller, quicker

Builds a random-weight Llama target with the embedded target's tokenizer, then trains the same short
Medusa run five ways with ``accelerate launch``: one process; 2 processes under ZeRO-2 (each holds
the whole target); 2 and 4 processes under ZeRO-3 with configs/accelerate/deepspeed_zero3.yaml (the
target created partitioned, each process reading its part of every weight from the files, at most
two decoder layers kept gathered: train/loop.py ``_bound_live_parameters``); and 2 processes under
ZeRO-3 with DeepSpeed's own limits (``stage3_max_live_parameters`` and ``stage3_max_reuse_distance``
1e9, set in a DeepSpeed config file), which keep a target this small gathered whole. Two figures per
launch: each worker's peak over the whole run (VmHWM in /proc/PID/status, read while it runs; the
table prints the largest), which adds to the shard what a training step gathers (the embedding,
which a tied target also uses as its LM head, two decoder layers and one prefetched) and
DeepSpeed's buffers; and process 0's peak once the target has loaded (the training loop prints its
VmHWM then: under ZeRO-3, what loading its shard cost). ``--layers 30`` makes a target of about
2.8 GB, where the gathered working set is a smaller share; ``--cap-gb G`` instead runs the four
launches with every process in a memory cgroup of its own limited to G GB (as one device's memory
would be) and says which train and which are killed. A benchmark, not a test: the figures
depend on the machine and the allocator.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def build_target(folder: pathlib.Path, layers: int, hidden: int) -> int:
    """A random Llama with SmolLM2's tokenizer in ``folder``; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfdraft.heads.target import load_target_tokenizer

    tokenizer, _ = load_target_tokenizer("smollm2-135m")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         tie_word_embeddings=True, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def peak_rss(pid: int) -> int:
    """VmHWM of a process in bytes, 0 once it is gone."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _loading_peak(text: str) -> float:
    """Process 0's peak resident bytes when the target has loaded (the training loop prints it)."""
    found = re.search(r"peak resident memory of this process so far: ([0-9.]+) GB", text)
    if found is None:
        raise SystemExit("the run did not print its peak memory after loading (no /proc/self/status?)")
    return float(found.group(1)) * 1e9


CGROUPS = pathlib.Path("/sys/fs/cgroup/memory")


def _cap(pid: int, cap: int) -> pathlib.Path:
    """Put ``pid`` in a memory cgroup (v1) of its own limited to ``cap`` bytes, as one device would be."""
    group = CGROUPS / f"selfdraft-bench-{pid}"
    group.mkdir()  # (memory it held before the move, its first imports, is not charged: this kernel
    # refuses memory.move_charge_at_immigrate; the workers are moved within 50 ms of starting)
    (group / "memory.limit_in_bytes").write_text(str(cap))
    (group / "cgroup.procs").write_text(str(pid))
    return group


def launch(args: list[str], env: dict[str, str], cap: int | None = None) -> tuple[list[int], float, str, int, int]:
    """Run ``accelerate launch ARGS``; returns (peak RSS of each worker, seconds, the output, exit code,
    workers the kernel killed for memory). With ``cap``, every worker runs in a memory cgroup of its own
    limited to that many bytes."""
    import psutil

    accelerate = shutil.which("accelerate", path=str(pathlib.Path(sys.executable).parent))
    start = time.perf_counter()
    peaks: dict[int, int] = {}
    groups: list[pathlib.Path] = []
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([accelerate, "launch", *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    command = " ".join(child.cmdline())
                except psutil.Error:  # gone or a zombie
                    continue
                if "selfdraft.train" in command and " launch " not in command:  # a worker, not the launcher
                    if cap is not None and child.pid not in peaks:
                        groups.append(_cap(child.pid, cap))
                    peaks[child.pid] = max(peaks.get(child.pid, 0), peak_rss(child.pid))
            time.sleep(0.05)
        log.seek(0)
        text = log.read().decode(errors="replace")
    oom_kills = 0
    for group in groups:
        control = (group / "memory.oom_control").read_text().split()
        oom_kills += int(control[control.index("oom_kill") + 1]) if "oom_kill" in control else 0
        for _ in range(50):  # the cgroup empties once its process is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        else:
            print(f"(could not remove {group}: rmdir it by hand)", file=sys.stderr)
    if proc.returncode != 0 and cap is None:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{text[-4000:]}")
    return sorted(peaks.values()), time.perf_counter() - start, text, proc.returncode, oom_kills


def _capped(run: list[str], ways: dict[str, list[str]], env: dict[str, str], cap_gb: float, work: pathlib.Path) -> None:
    """Each launch again with every process capped at ``cap_gb``: which of them can run at all."""
    if not os.access(CGROUPS, os.W_OK):
        print(f"\n(no capped runs: {CGROUPS} is not writable here, so no process can be given a memory limit)")
        return
    print(f"\nEvery process capped at {cap_gb:g} GB (a memory cgroup each, as one device's memory):\n\n"
          "| launch | result |\n|---|---|")
    for name, how in ways.items():
        peaks, seconds, text, code, kills = launch([*how, *run, f"train.output_dir={work / ('capped-' + name.replace(' ', '_'))}"],
                                           env, cap=int(cap_gb * 1e9))
        result = (f"trained (peak {max(peaks) / 1e9:.2f} GB, {seconds:.0f} s)" if code == 0 else
                  f"{kills} of {len(peaks)} processes killed for memory" if kills else
                  f"failed (exit {code}): {text.strip().splitlines()[-1][:120]}")
        print(f"| {name} | {result} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1152)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cap-gb", type=float, default=0.0, help="instead, run the launches with every process "
                   "limited to this much memory (a memory cgroup each), to show which can run at all")
    args = p.parse_args()

    work = pathlib.Path(tempfile.mkdtemp(prefix="zero3-memory-"))
    try:
        target = work / "target"
        params = build_target(target, args.layers, args.hidden)
        print(f"target: random Llama, {args.layers} layers, hidden {args.hidden}, {params / 1e6:.0f} M parameters, "
              f"{params * 4 / 1e9:.2f} GB in fp32")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        env.pop("ACCELERATE_USE_CPU", None)  # with it, accelerate runs a DeepSpeed config as plain DDP
        # glibc raises its mmap threshold after large frees and then keeps freed gathers in the heap: a
        # fixed threshold returns them, so the figures count what is held, not what the allocator kept.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        print(f"MALLOC_MMAP_THRESHOLD_={env['MALLOC_MMAP_THRESHOLD_']}")
        run = ["-m", "selfdraft.train", "--config", "smoke_cpu", f"target.spec={target}", "target.dtype=float32",
               "data.max_conversations=16", "data.max_length=64", "data.eval_fraction=0.25", "train.micro_batch_size=1",
               "train.grad_accum=1", f"train.max_steps={args.steps}", "train.eval_every=0", "train.eval_batches=1",
               f"train.save_every={args.steps}", "train.num_threads=1", "train.dist_timeout_minutes=20"]
        accel = REPO / "configs" / "accelerate"
        (work / "ds.json").write_text(json.dumps({
            "zero_optimization": {"stage": 3, "stage3_max_live_parameters": int(1e9), "stage3_max_reuse_distance": int(1e9)},
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}))
        (work / "zero3_deepspeed_limits.yaml").write_text(
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
            f"  deepspeed_config_file: {work / 'ds.json'}\n  zero3_init_flag: true\n"
            "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\n")
        zero3 = ["--config_file", str(accel / "deepspeed_zero3.yaml")]
        ways = {
            "1 process": ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
            "2 processes, ZeRO-2": ["--config_file", str(accel / "deepspeed_zero2.yaml")],
            "2 processes, ZeRO-3": zero3,
            "4 processes, ZeRO-3": [*zero3, "--num_processes", "4"],
            "2 processes, ZeRO-3, DeepSpeed's 1e9 live": ["--config_file", str(work / "zero3_deepspeed_limits.yaml")],
        }
        if args.cap_gb:
            _capped(run, {k: v for k, v in ways.items() if "DeepSpeed's" not in k}, env, args.cap_gb, work)
            return
        rows = []
        for name, how in ways.items():
            peaks, seconds, text, _, _ = launch([*how, *run, f"train.output_dir={work / name.replace(' ', '_').replace(chr(39), '')}"], env)
            held = next((line for line in text.splitlines() if "partitioned: this process holds" in line), "")
            rows.append((name, peaks, seconds, held, text))
            print(f"{name}: peak RSS per process {', '.join(f'{b / 1e9:.2f} GB' for b in peaks)} ({seconds:.0f} s)", flush=True)
        base = max(rows[0][1])
        loaded = [_loading_peak(text) for *_, text in rows]
        print("\n| launch | peak RSS of the run, largest process | vs 1 process | peak RSS once the target is "
              "loaded (process 0) | wall |\n|---|---|---|---|---|")
        for (name, peaks, seconds, _, _), load in zip(rows, loaded):
            print(f"| {name} | {max(peaks) / 1e9:.2f} GB | {max(peaks) / base:.2f}x | {load / 1e9:.2f} GB | {seconds:.0f} s |")
        print("(once loaded, one process and ZeRO-2 have not yet read most weights: transformers maps the "
              "safetensors file and reads a weight at its first use)")
        for name, _, _, held, _ in rows:
            if held:
                print(f"{name}: {held.split('selfdraft: ')[-1]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
