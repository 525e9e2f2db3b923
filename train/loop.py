"""The one training loop, for every drafter kind, on one CPU or many GPUs through accelerate.

    accelerate launch -m selfdraft.train --config configs/medusa_smollm2.yaml train.lr=3e-4
    selfdraft train --config smoke_cpu                      # one process, same code

The run folder (``train.output_dir``) receives ``config.yaml`` (the resolved config), ``data/`` (the
rendered dataset, reused on resume), ``checkpoints/step-N/`` (the last ``keep_last``), ``metrics.jsonl``,
``training.png`` (loss and per-head accuracy curves), and at the end ``drafter/``: the native export,
with a sparse tree built from the measured accuracies.

Data order is a pure function of (seed, step): global batch s takes positions [s*G, (s+1)*G) of an
endless stream of per-epoch permutations, and process r of P takes micro batch m's slice r. A resumed
run therefore sees exactly the batches the uninterrupted run would have seen; the optimizer,
scheduler and RNG states come back from the checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import dataclasses
import json
import math
import os
import pathlib
import shutil
import sys
import time
from typing import Any

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from selfdraft.configs.run import RunConfig
from selfdraft.configs.schema import to_dict
from selfdraft.errors import SelfdraftError
from selfdraft.files import as_if_created
from selfdraft.train import checkpoint as ckpt
from selfdraft.train.profile import StepProfile

# Keys whose change is allowed when resuming (they do not change what the finished run computes,
# or only extend it).
RESUMABLE_CHANGES = {"train.max_steps", "train.eval_every", "train.eval_batches", "train.save_every",
                     "train.keep_last", "train.log_every", "train.report_to", "train.wandb_project",
                     "train.wandb_mode", "train.num_threads", "train.features", "train.dist_timeout_minutes", "train.data_dir",
                     "train.render_processes"}


class TrainingDiverged(SelfdraftError):
    """The loss or the gradient norm became NaN/inf; the run stopped without saving."""


@dataclasses.dataclass
class TrainResult:
    output_dir: pathlib.Path
    step: int
    drafter_dir: pathlib.Path | None
    """The native export, written when the run reached max_steps."""
    last_eval: dict[str, Any]
    train_tokens_per_second: float
    train_seconds: float = 0.0
    """Seconds spent in optimizer steps by this call (loading, evaluation and saving excluded)."""
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    """Each optimizer step's seconds, in order (the first pays one-off costs: plan from the others)."""
    target_seconds: float = 0.0
    """Of ``train_seconds``, those in the target's forward (online features; 0 with a feature cache):
    what a cache would save per step (``selfdraft.train.budget``)."""
    objective: Any = None
    """The trained module (target + drafter), unwrapped from accelerate, on its device."""


# ----------------------------------------------------------------------------------------------
# Data


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def data_key(config: RunConfig, tokenizer) -> dict[str, Any]:
    """What the rendered train/eval split is a function of."""
    from selfdraft.heads.target import tokenizer_fingerprint

    return {"data": to_dict(config.data), "tokenizer": tokenizer_fingerprint(tokenizer)}


def data_folder(config: RunConfig) -> pathlib.Path:
    """The folder of the rendered split: ``train.data_dir`` (node-local) or ``output_dir/data`` (shared)."""
    return pathlib.Path(config.train.data_dir or pathlib.Path(config.train.output_dir) / "data")


def check_context(config: RunConfig, max_context: int) -> None:
    """A conversation of ``data.max_length`` tokens must fit the target's context: past its
    ``max_position_embeddings`` the features would come from positions the target never learned
    (RoPE computes them silently)."""
    if config.data.max_length > max_context:
        raise SelfdraftError(f"data.max_length {config.data.max_length} is longer than the target's context "
                             f"({max_context} positions, its max_position_embeddings): set data.max_length <= {max_context}")


def prepare_data(config: RunConfig, tokenizer, accelerator) -> tuple[list, list]:
    """Render (or reload) the train/eval split in :func:`data_folder`; returns lists of (input_ids,
    loss_mask) int arrays.

    One process per filesystem renders: the global main process for the run's own folder, each node's
    local main process for a node-local ``train.data_dir``; the others wait (at most
    ``train.dist_timeout_minutes``) and read it."""
    import datasets

    from selfdraft.train.data import build_datasets

    key = data_key(config, tokenizer)
    folder = data_folder(config)
    marker = folder / "fingerprint.json"
    renders = accelerator.is_local_main_process if config.train.data_dir else accelerator.is_main_process
    if renders:
        fresh = not (marker.is_file() and json.loads(marker.read_text()) == key)
        if fresh:
            train_ds, eval_ds = build_datasets(config.data, tokenizer, processes=config.train.render_processes)
            work = folder.parent / f".{folder.name}.tmp"
            shutil.rmtree(work, ignore_errors=True)
            train_ds.save_to_disk(str(work / "train"))
            eval_ds.save_to_disk(str(work / "eval"))
            (work / "fingerprint.json").write_text(json.dumps(key))
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(work, folder)
    accelerator.wait_for_everyone()

    def load(name):
        ds = datasets.load_from_disk(str(folder / name)).with_format("numpy")
        return [(np.asarray(r["input_ids"], dtype=np.int64), np.asarray(r["loss_mask"], dtype=np.int64)) for r in ds]

    return load("train"), load("eval")


def batch_positions(step: int, micro: int, rank: int, *, micro_batch: int, grad_accum: int, world: int) -> range:
    """Stream positions of process ``rank``'s micro batch ``micro`` in optimizer step ``step``."""
    start = ((step * grad_accum + micro) * world + rank) * micro_batch
    return range(start, start + micro_batch)


def stream_index(position: int, n: int, seed: int, _cache: dict = {}) -> int:
    """Example index at ``position`` of the endless stream of seeded per-epoch permutations of n."""
    epoch, offset = divmod(position, n)
    key = (n, seed, epoch)
    if key not in _cache:
        if len(_cache) > 4:
            _cache.clear()
        _cache[key] = np.random.default_rng([seed, epoch]).permutation(n)
    return int(_cache[key][offset])


MIN_BATCH_LENGTH = 3
"""Every batch has at least this many positions (EAGLE pairs a feature at t with tokens t+1 and t+2),
so that no objective has to skip a batch, which under ZeRO-3 would desynchronise the processes."""


def pack_rows(lengths: list[int], pack_tokens: int) -> list[list[int]]:
    """Which examples share a row when a micro batch is packed: first-fit decreasing into rows of at
    most ``pack_tokens`` tokens (longest first, ties by order); each row lists its examples in order.
    With ``pack_tokens`` 0 every example has a row of its own."""
    if pack_tokens <= 0:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > pack_tokens:
            raise SelfdraftError(f"a conversation of {lengths[i]} tokens does not fit a packed row of train.pack_tokens="
                                 f"{pack_tokens}: set train.pack_tokens >= data.max_length")
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(pack_tokens)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return [sorted(row) for row in rows]


def _placement(lengths: list[int], pack_tokens: int) -> list[tuple[int, int]]:
    """(row, start) of each example in a batch laid out by :func:`pack_rows`."""
    placement = [(0, 0)] * len(lengths)
    for r, row in enumerate(pack_rows(lengths, pack_tokens)):
        start = 0
        for i in row:
            placement[i] = (r, start)
            start += lengths[i]
    return placement


def collate(examples: list[tuple[np.ndarray, np.ndarray]], pad_id: int, device,
            pack_tokens: int = 0) -> dict[str, torch.Tensor]:
    """One batch of (R, T) tensors from a list of (input_ids, loss_mask), T >= MIN_BATCH_LENGTH.

    Unpacked (``pack_tokens`` 0): a row per example, right-padded. Packed: the examples share rows of
    at most ``pack_tokens`` tokens (:func:`pack_rows`), one after another, and ``position_ids`` (R, T)
    restart at 0 where each begins; the padding at a row's end is a block of its own (positions from
    0 again), and ``attention_mask`` is 0 there. A position's conversation is the number of zeros in
    ``position_ids`` up to it: the target and the drafters attend within it only."""
    placement = _placement([len(ids) for ids, _ in examples], pack_tokens)
    R = 1 + max(r for r, _ in placement)
    ends = [0] * R  # where each row's tokens end
    for (r, start), (x, _) in zip(placement, examples):
        ends[r] = max(ends[r], start + len(x))
    T = max(MIN_BATCH_LENGTH, *ends)
    ids = np.full((R, T), pad_id, dtype=np.int64)
    attn = np.zeros((R, T), dtype=np.int64)
    mask = np.zeros((R, T), dtype=np.int64)
    pos = np.zeros((R, T), dtype=np.int64)
    for (r, start), (x, m) in zip(placement, examples):
        end = start + len(x)
        ids[r, start:end], attn[r, start:end], mask[r, start:end] = x, 1, m
        pos[r, start:end] = np.arange(len(x))
    for r, end in enumerate(ends):
        pos[r, end:] = np.arange(T - end)
    tensors = [("input_ids", ids), ("attention_mask", attn), ("loss_mask", mask)]
    if pack_tokens > 0:
        tensors.append(("position_ids", pos))
    return {k: torch.from_numpy(v).to(device) for k, v in tensors}


def make_batch(data: list, indices: list[int], pad_id: int, device, cache=None, split: str = "train",
               pack_tokens: int = 0, unscored: int = 0) -> dict[str, torch.Tensor]:
    """``collate`` of ``data[indices]``, plus their precomputed target features from ``cache``, laid
    out as ``collate`` lays out their tokens; the last ``unscored`` examples with their loss mask
    zeroed (they run through every module and count nothing)."""
    examples = [data[i] for i in indices]
    for k in range(len(examples) - unscored, len(examples)):
        examples[k] = (examples[k][0], np.zeros_like(examples[k][1]))
    batch = collate(examples, pad_id, device, pack_tokens)
    if cache is not None:
        batch["features"] = cache.batch(split, indices, batch["input_ids"].shape[1], device,
                                        placement=_placement([len(ids) for ids, _ in examples], pack_tokens),
                                        rows=batch["input_ids"].shape[0])
    return batch


# ----------------------------------------------------------------------------------------------
# Schedule, evaluation, export


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _add_stats(total: dict | None, stats: dict) -> dict:
    if total is None:
        return {k: v.detach().clone() for k, v in stats.items()}
    for k, v in stats.items():
        total[k] = total[k] + v.detach() if k in total else v.detach().clone()
    return total


@torch.no_grad()
def evaluate(objective, eval_data: list, config: RunConfig, accelerator, pad_id: int,
             cache=None) -> tuple[dict[str, float], torch.Tensor]:
    """Per-head loss and top-1/top-k accuracy on the held-out split, summed over processes.

    Returns (metrics, rank accuracy (K, R)) where rank accuracy feeds the sparse tree."""
    from selfdraft.train.objectives import rank_accuracy, summarise

    model = objective  # the prepared (wrapped) module: DeepSpeed must run its own forward
    was_training = model.training
    model.eval()
    mb, world, rank = config.train.micro_batch_size, accelerator.num_processes, accelerator.process_index
    n_batches = math.ceil(len(eval_data) / mb)
    if config.train.eval_batches:
        n_batches = min(n_batches, config.train.eval_batches * world)
    # Batch b goes to process b % world. Every process runs the same forwards (ZeRO-3 gathers parameters
    # collectively, and the target runs once per conversation on a CPU): every batch holds mb
    # conversations, the last real one and those of a process without a batch of its own in the last
    # round filled up with conversations whose loss mask is zeroed, which count nothing.
    total = None
    for b in range(rank, math.ceil(n_batches / world) * world, world):
        real = list(range(b * mb, min((b + 1) * mb, len(eval_data)))) if b < n_batches else []
        fillers = [i % len(eval_data) for i in range(mb - len(real))]
        batch = make_batch(eval_data, real + fillers, pad_id, accelerator.device, cache, "eval",
                           pack_tokens=config.train.pack_tokens, unscored=len(fillers))
        with accelerator.autocast():
            _, stats = model(**batch)
        total = _add_stats(total, stats)
    total = {k: accelerator.reduce(v, reduction="sum") for k, v in sorted(total.items())}
    model.train(was_training)
    metrics = {f"eval/{k}": v for k, v in summarise(total).items()}
    accuracy = rank_accuracy(total)
    metrics["eval/predicted_tau"] = predicted_tau(config, accuracy)
    return metrics, accuracy


def predicted_tau(config: RunConfig, accuracy: torch.Tensor) -> float:
    """The acceptance length held-out rank accuracies (K, R) predict for the run's tree: Medusa's
    ``tree_nodes`` sparse tree, or EAGLE's ``tree_nodes``-node tree of depth ``tree_depth`` and top-k
    ``tree_top_k`` (``inference.medusa.expected_acceptance``)."""
    from selfdraft.inference.medusa import expected_acceptance

    if config.drafter.kind == "medusa":
        return expected_acceptance(accuracy, config.drafter.medusa.tree_nodes)
    e = config.drafter.eagle
    return expected_acceptance(accuracy[:e.tree_depth, :e.tree_top_k], e.tree_nodes)


def evaluation_record(last_eval: dict[str, float], step: int, top_k: int) -> dict[str, Any] | None:
    """Per-depth held-out accuracies of an evaluation (``eval/top1/head{k}``...), as a drafter
    record's ``evaluation``; None before the first evaluation."""
    depths = sorted(int(k.rsplit("head", 1)[1]) for k in last_eval if k.startswith("eval/top1/head"))
    if not depths:
        return None
    return {"step": step, "top_k": top_k,
            "top1": [round(last_eval[f"eval/top1/head{k}"], 4) for k in depths],
            "topk": [round(last_eval[f"eval/topk/head{k}"], 4) if f"eval/topk/head{k}" in last_eval else None
                     for k in depths]}


def export_drafter(objective, config: RunConfig, target, rank_acc: torch.Tensor | None, out: pathlib.Path,
                   evaluation: dict[str, Any] | None = None, state: dict[str, torch.Tensor] | None = None) -> pathlib.Path:
    """Write the native drafter folder (and, in Medusa-2, the LoRA-merged target next to it);
    ``evaluation`` (see :func:`evaluation_record`) goes into the record for model cards. ``state``: the
    trained tensors in full when the objective's own are shards (FSDP)."""
    from selfdraft.heads.io import DrafterRecord, medusa_dims, save_drafter
    from selfdraft.heads.target import TargetIdentity, tokenizer_fingerprint
    from selfdraft.inference.medusa import CPU_CHOICES, sparse_tree

    identity = target.identity
    if config.drafter.kind in ("eagle", "eagle3"):
        e = config.drafter.eagle
        drafter = objective.drafter_module(state)
        record = DrafterRecord(kind=config.drafter.kind, dims=drafter.dims, target=identity,
                               decode={"tree": {"depth": e.tree_depth, "top_k": e.tree_top_k, "max_nodes": e.tree_nodes}},
                               run_config=to_dict(config), evaluation=evaluation)
        return save_drafter(out, drafter, record)
    heads = objective.drafter_module(state)
    if objective.lora:
        merged_dir = out.parent / f"{out.name}-target"
        merged = objective.merged_target()
        work = out.parent / f".{merged_dir.name}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        merged.save_pretrained(work, safe_serialization=True)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(work)
        as_if_created(work)
        shutil.rmtree(merged_dir, ignore_errors=True)
        os.rename(work, merged_dir)
        identity = dataclasses.replace(identity, name=str(merged_dir), tokenizer_hash=tokenizer_fingerprint(target.tokenizer))
        assert isinstance(identity, TargetIdentity)
    m = config.drafter.medusa
    decode: dict[str, Any] = {"choices": [list(c) for c in CPU_CHOICES if len(c) <= heads.num_heads]}
    if rank_acc is not None:
        decode = {"choices": [list(c) for c in sparse_tree(rank_acc, m.tree_nodes)],
                  "rank_accuracy": [[round(float(a), 6) for a in row] for row in rank_acc]}
    record = DrafterRecord(kind="medusa", dims=medusa_dims(heads), target=identity, decode=decode,
                           run_config=to_dict(config), evaluation=evaluation)
    return save_drafter(out, heads, record)


# ----------------------------------------------------------------------------------------------
# The loop


def _config_changes(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def resolve_mixed_precision(value: str | None) -> str | None:
    """``train.mixed_precision`` as accelerate takes it: ``auto`` becomes bf16 where the hardware
    multiplies bf16 natively (a CUDA GPU that supports it; a CPU with AVX-512 BF16 or AMX), else no."""
    if value != "auto":
        return value
    if _trains_on_gpu():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    from selfdraft.machine import cpu_has_bf16

    return "bf16" if cpu_has_bf16() else "no"


def _trains_on_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "false").lower() != "true"


def _bf16_reason() -> str:
    from selfdraft.machine import cpu_flags

    return "a GPU" if _trains_on_gpu() else f"CPU flags {' '.join(cpu_flags()) or 'unknown'}"


def fresh_accelerate_state() -> None:
    """Forget accelerate's process-wide state. It is global (accelerate 1.15), so a second run in the
    same Python process (the quickstart's calibration and then its run, a sweep, a notebook) with
    another mixed precision would be refused ("AcceleratorState has already been initialized").
    Only for a process that no launcher started: that run owns it, and starts as a new process would."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _make_accelerator(config: RunConfig, out: pathlib.Path):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    t = config.train
    # Several processes without GPUs talk over gloo (DeepSpeed on CPU needs it said explicitly); every
    # collective gives up after train.dist_timeout_minutes.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = []
    if launched:
        timeout = datetime.timedelta(minutes=t.dist_timeout_minutes)
        handlers.append(InitProcessGroupKwargs(timeout=timeout, **({} if torch.cuda.is_available() else {"backend": "gloo"})))
    if t.report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", t.wandb_mode)
    # accelerate (1.15) selects FSDP only on accelerators: launched with an FSDP config on CPUs its
    # processes would run unsharded and unsynchronised. Run them as CPU processes (gloo), then switch
    # the state to FSDP, so that prepare() shards with FSDP2 exactly as it does on GPUs.
    fsdp_on_cpu = launched and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not torch.cuda.is_available()
    if not launched:
        fresh_accelerate_state()
    # train.mixed_precision unset: accelerate's own setting (its config file / launch flag, else "no").
    accelerator = Accelerator(mixed_precision=resolve_mixed_precision(t.mixed_precision), gradient_accumulation_steps=t.grad_accum,
                              log_with="wandb" if t.report_to == "wandb" else None, project_dir=str(out),
                              kwargs_handlers=handlers, **({"cpu": True} if fsdp_on_cpu else {}))
    if fsdp_on_cpu:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
        if plugin.fsdp_version != 2:
            raise SelfdraftError("FSDP on CPUs runs FSDP2 only: set fsdp_version: 2 in the accelerate config")
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState syncs it
        if accelerator.is_main_process:
            print("selfdraft: accelerate's FSDP config on CPUs: FSDP2 over gloo", file=sys.stderr, flush=True)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and accelerator.distributed_type.name != "DEEPSPEED":
        raise SelfdraftError("accelerate was launched with a DeepSpeed config but runs without DeepSpeed (ACCELERATE_USE_CPU "
                             "or --cpu turns it off): unset it; on CPUs set DS_ACCELERATOR=cpu instead")
    if accelerator.is_main_process:
        source = {None: "accelerate's config", "auto": f"train.mixed_precision auto, {_bf16_reason()}"}.get(
            t.mixed_precision, "train.mixed_precision")
        print(f"selfdraft: mixed precision {accelerator.mixed_precision} (from {source}) on {accelerator.device}",
              file=sys.stderr, flush=True)
    return accelerator


def train(config: RunConfig, *, resume: bool | str | os.PathLike = False, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) a training run; see the module docstring. ``stop_after`` ends the run after
    that many optimizer steps without finishing it (as a crash would, but after a checkpoint)."""
    from accelerate.utils import DistributedType, set_seed

    from selfdraft.heads.target import load_target, target_folder
    from selfdraft.machine import peak_resident_bytes
    from selfdraft.train.partitioned import load_partitioned
    from selfdraft.train.objectives import build_objective, summarise

    t = config.train
    out = pathlib.Path(t.output_dir)
    ckpt_root = out / "checkpoints"
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    accelerator = _make_accelerator(config, out)
    world, rank, main = accelerator.num_processes, accelerator.process_index, accelerator.is_main_process
    if _fsdp(accelerator) and config.drafter.kind == "medusa" and config.drafter.medusa.lora.rank > 0:
        raise SelfdraftError("Medusa-2 (LoRA on the target) does not train under FSDP here: its export merges the "
                             "adapters into a whole target. Use DeepSpeed ZeRO-3 (configs/accelerate/deepspeed_zero3.yaml), "
                             "which shards the target and is tested with it, or Medusa-1 (drafter.medusa.lora.rank=0)")

    # Resume point, decided before anything is written.
    resume_from: pathlib.Path | None = None
    if resume:
        resume_from = pathlib.Path(resume) if not isinstance(resume, bool) else ckpt.latest_checkpoint(ckpt_root)
        if resume_from is None:
            raise SelfdraftError(f"--resume: {ckpt_root} has no complete checkpoint to resume from")
        state = ckpt.read_state(resume_from)
        changes = [k for k in _config_changes(state["config"], to_dict(config)) if k not in RESUMABLE_CHANGES]
        if changes:
            raise SelfdraftError(f"cannot resume {resume_from} with a different config: {', '.join(changes)} changed")
        if state["world_size"] != world:
            raise SelfdraftError(f"{resume_from} was written by {state['world_size']} processes, this run has {world}; "
                                 "resume with the same number (the data order depends on it)")
    elif ckpt.latest_checkpoint(ckpt_root) is not None:
        raise SelfdraftError(f"{out} already holds checkpoints: pass --resume to continue that run, "
                             "or set train.output_dir to a new folder")

    set_seed(t.seed)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False), encoding="utf-8")
    # A built-in target is converted once per node (its cache is usually node-local; on a shared one the
    # conversion is atomic, so two nodes converting at once waste time, nothing else).
    with accelerator.local_main_process_first():
        target_folder(config.target.spec)
    # Every rank loads at once. Under ZeRO-3 the target is created partitioned (deepspeed.zero.Init,
    # whatever zero3_init_flag says): each rank keeps its shard of every weight, never the whole model,
    # and the loading collectives need all ranks.
    # Under FSDP it stays in CPU memory until prepare() shards it onto the device (with accelerate's
    # fsdp_cpu_ram_efficient_loading, only local rank 0 reads the weights; the others hold it on meta).
    with _partitioned_creation(accelerator):
        target = load_target(config.target.spec, dtype=config.target.dtype,
                             device="cpu" if _fsdp(accelerator) else str(accelerator.device),
                             trust_remote_code=config.target.trust_remote_code,
                             model_loader=load_partitioned if _zero3(accelerator) else None)
    if target.tokenizer is None:
        raise SelfdraftError(f"target {config.target.spec} has no tokenizer: training needs its chat template")
    check_context(config, target.max_context)
    if main:
        peak = peak_resident_bytes()
        peak = f" (peak resident memory of this process so far: {peak / 1e9:.2f} GB)" if peak else ""
        if _zero3(accelerator):
            held = sum(p.ds_tensor.numel() for p in target.model.parameters())
            whole = sum(p.ds_numel for p in target.model.parameters())
            print(f"selfdraft: ZeRO-3 created the target partitioned: this process holds {held:,} of its {whole:,} "
                  f"parameters{peak}", file=sys.stderr, flush=True)
        else:
            print(f"selfdraft: loaded the target{peak}", file=sys.stderr, flush=True)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    train_data, eval_data = prepare_data(config, target.tokenizer, accelerator)
    if not eval_data:
        raise SelfdraftError("the held-out split is empty: raise data.eval_fraction or give more conversations")
    if len(train_data) < world * t.micro_batch_size:  # every process sees the same split: all raise
        raise SelfdraftError(f"{world} processes x train.micro_batch_size {t.micro_batch_size} need at least "
                             f"{world * t.micro_batch_size} training conversations, the split has {len(train_data)}: "
                             "launch fewer processes or give more data (data.max_conversations)")

    objective = build_objective(config, target.model, train_data)
    if _fsdp(accelerator):
        # Auto-wrap: each of the target's decoder layers is an FSDP unit. The root unit holds the drafter
        # with the target's embedding, final norm and LM head, which the losses read outside any layer's
        # forward (a drafter layer of the target's class is a unit of its own, used in its forward only).
        objective._no_split_modules = list(getattr(target.model, "_no_split_modules", None) or [])
    else:
        objective.to(accelerator.device)
    cache = None
    if t.features:
        from selfdraft.train.features import open_feature_cache

        cache = open_feature_cache(config, target, objective.feature_layers)
        G = t.micro_batch_size * t.grad_accum * world
        cache.check_covers("train", {stream_index(p, len(train_data), t.seed) for p in range(t.max_steps * G)})
        cache.check_covers("eval", range(len(eval_data)))
        if main:
            print(f"streaming the target's features from {t.features}")
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=t.lr,
                                  betas=tuple(t.betas), weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, t.max_steps, t.min_lr_ratio))
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
        ds["gradient_clipping"] = t.max_grad_norm
        if _zero3(accelerator):
            _bound_live_parameters(ds.setdefault("zero_optimization", {}), target.model, main)
    with _persistent_buffers_hidden(accelerator, objective):
        model, optimizer = accelerator.prepare(objective, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    params = [p for p in model.parameters() if p.requires_grad]  # after prepare: FSDP2 replaces them with DTensors
    if _fsdp(accelerator) and main:
        from torch.distributed.tensor import DTensor

        weights = list(unwrapped.target.parameters())
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in weights)
        print(f"selfdraft: FSDP sharded the target: this process holds {held:,} of its {sum(p.numel() for p in weights):,} "
              "parameters", file=sys.stderr, flush=True)

    start_step, last_eval, rank_acc = 0, {}, None
    if resume_from is not None:
        state = ckpt.read_state(resume_from)
        try:
            with _full_parameters(accelerator, unwrapped, modify=True):
                unwrapped.load_trainable_state_dict(ckpt.load_tree(resume_from, "trainable"))
            if state["sharded_optimizer"]:  # ZeRO: every rank reads every partition's state
                parts = [ckpt.load_tree(resume_from, f"optimizer-rank{r}") for r in range(world)]
                for part in parts:  # the static loss scaler _zero_state_dict left out (a Python object)
                    part.setdefault("loss_scaler", model.optimizer.loss_scaler)
                model.optimizer.load_state_dict(parts, load_from_fp32_weights=True)
            else:
                _load_optimizer_state(accelerator, model, optimizer, ckpt.load_tree(resume_from, "optimizer"))
            ckpt.set_rng_state(ckpt.load_tree(resume_from, f"rng-rank{rank}"))
        except SelfdraftError as err:
            others = [str(p) for p in ckpt.list_checkpoints(ckpt_root) if p != resume_from]
            hint = f"; resume from an earlier one with --resume-from {others[-1]}" if others else ""
            raise SelfdraftError(f"cannot resume from {resume_from}: {err}{hint}") from err
        scheduler.load_state_dict(state["scheduler"])
        start_step, last_eval = state["step"], state.get("last_eval", {})
        rank_acc = torch.tensor(state["rank_accuracy"]) if state.get("rank_accuracy") else None
        if main:
            _truncate_metrics(out / "metrics.jsonl", start_step)
            print(f"resuming from {resume_from} at step {start_step}")

    if t.report_to != "none":
        accelerator.init_trackers(t.wandb_project, config=_flatten(to_dict(config)),
                                  init_kwargs={"wandb": {"name": config.name, "dir": str(out), "mode": t.wandb_mode}})
    sharded_optimizer = accelerator.distributed_type == DistributedType.DEEPSPEED

    def save(step: int) -> pathlib.Path:
        work = ckpt.staging_dir(ckpt_root, step)
        if main:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
        accelerator.wait_for_everyone()
        trainable = _trainable_state(accelerator, unwrapped)
        optimizer_state = None if sharded_optimizer else _optimizer_state(accelerator, model, optimizer)
        if main:
            ckpt.save_tree(work, "trainable", trainable)
            if optimizer_state is not None:
                ckpt.save_tree(work, "optimizer", optimizer_state)
        if sharded_optimizer:
            ckpt.save_tree(work, f"optimizer-rank{rank}", _zero_state_dict(optimizer))
        ckpt.save_tree(work, f"rng-rank{rank}", ckpt.rng_state())
        accelerator.wait_for_everyone()
        path = ckpt.checkpoint_dir(ckpt_root, step)
        if main:
            path = ckpt.publish(ckpt_root, step, {
                "step": step, "world_size": world, "sharded_optimizer": sharded_optimizer,
                "scheduler": scheduler.state_dict(), "last_eval": last_eval,
                "rank_accuracy": rank_acc.tolist() if rank_acc is not None else None,
                "config": to_dict(config)}, t.keep_last)
        accelerator.wait_for_everyone()
        return path

    progress = tqdm(total=t.max_steps, initial=start_step, desc=f"training {config.name}", unit="step",
                    disable=not main or None)
    model.train()
    tokens_done, time_spent, step_seconds = 0, 0.0, []
    phases = StepProfile(accelerator.device, only={"target forward"})  # what a feature cache would save
    window, window_steps = None, 0
    end = t.max_steps if stop_after is None else min(t.max_steps, stop_after)
    step = start_step
    for step in range(start_step, end):
        began = time.perf_counter()
        step_tokens = torch.zeros((), device=accelerator.device)
        step_stats = None
        for micro in range(t.grad_accum):
            positions = batch_positions(step, micro, rank, micro_batch=t.micro_batch_size, grad_accum=t.grad_accum, world=world)
            batch = make_batch(train_data, [stream_index(p, len(train_data), t.seed) for p in positions], pad_id,
                               accelerator.device, cache, pack_tokens=t.pack_tokens)
            with accelerator.accumulate(model), accelerator.autocast():
                with phases.recording():
                    loss, stats = model(**batch)
                finite = accelerator.reduce(torch.isfinite(loss.detach()).float().reshape(1), reduction="sum")
                if float(finite) < world:
                    last = ckpt.latest_checkpoint(ckpt_root)
                    raise TrainingDiverged(
                        f"the loss became {float(loss.detach())} at step {step + 1} (micro batch {micro}); stopped without "
                        f"saving. Last good checkpoint: {last or 'none yet'}. Lower train.lr or check the data.")
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and t.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(params, t.max_grad_norm)
                if grad_norm is not None and not math.isfinite(float(grad_norm)):
                    raise TrainingDiverged(f"the gradient norm became {float(grad_norm)} at step {step + 1}; stopped "
                                           f"without saving. Last good checkpoint: {ckpt.latest_checkpoint(ckpt_root) or 'none yet'}")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_tokens += batch["attention_mask"].sum()
            step_stats = _add_stats(step_stats, {**stats, "loss": loss.detach().float().reshape(1)})
        scheduler.step()
        done = step + 1
        step_tokens = float(accelerator.reduce(step_tokens, reduction="sum"))
        tokens_done += step_tokens
        step_seconds.append(time.perf_counter() - began)
        time_spent += step_seconds[-1]
        window, window_steps = _add_stats(window, step_stats), window_steps + 1
        progress.update(1)
        if done % t.log_every == 0 or done == end:
            window = {k: accelerator.reduce(v, reduction="sum") for k, v in sorted(window.items())}
            metrics = {"train/loss": float(window["loss"].sum()) / (t.grad_accum * world * window_steps),
                       **{f"train/{k}": v for k, v in summarise(window).items()},
                       "lr": scheduler.get_last_lr()[0], "tokens_per_second": tokens_done / max(time_spent, 1e-9)}
            if grad_norm is not None:
                metrics["grad_norm"] = float(grad_norm)
            window, window_steps = None, 0
            progress.set_postfix(loss=f"{metrics['train/loss']:.3f}", top1=f"{metrics.get('train/top1/head0', 0):.2f}")
            _log(accelerator, out, done, metrics, t.report_to != "none")
        if (t.eval_every and done % t.eval_every == 0) or done == t.max_steps:
            last_eval, rank_acc = evaluate(model, eval_data, config, accelerator, pad_id, cache)
            _log(accelerator, out, done, last_eval, t.report_to != "none")
            if main:
                progress.write(f"step {done}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in last_eval.items()
                                                           if "top1" in k or "loss" in k))
        if (t.save_every and done % t.save_every == 0) or done == end:
            save(done)
    progress.close()

    finished = end == t.max_steps
    if finished:
        state = _trainable_state(accelerator, unwrapped)  # all processes: a collective under ZeRO-3 and FSDP
        # Medusa-2 merges its LoRA weights into the target: under ZeRO-3 they must be gathered for that.
        with _full_parameters(accelerator, unwrapped) if unwrapped.lora else contextlib.nullcontext():
            if main:
                evaluation = evaluation_record(last_eval, end, t.top_k)
                folder = export_drafter(unwrapped, config, target, rank_acc, out / "drafter", evaluation, state)
                print(f"wrote the drafter to {folder}")
    if main:
        from selfdraft.train.plots import plot_metrics

        plot_metrics(out / "metrics.jsonl", out / "training.png")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return TrainResult(output_dir=out, step=end if end > start_step else start_step,
                       drafter_dir=out / "drafter" if finished else None, last_eval=last_eval,
                       train_tokens_per_second=tokens_done / max(time_spent, 1e-9), train_seconds=time_spent,
                       step_seconds=step_seconds, target_seconds=phases.seconds.get("target forward", 0.0),
                       objective=unwrapped)


def _zero3(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3


def _bound_live_parameters(zero: dict, model, announce: bool) -> None:
    """ZeRO-3 limits a DeepSpeed config file leaves unset: at most two of the target's decoder layers
    stay gathered between uses, and one layer's worth is prefetched (DeepSpeed's 5e7 elements would
    prefetch several layers of a small target). DeepSpeed's default (1e9 parameters, 1e9 distance) keeps a whole
    target of that size gathered on every process once it has run; the frozen target never needs its
    weights again in the backward, so releasing them after each layer costs no extra gather."""
    layers = [m for m in model.modules() if type(m).__name__ in set(getattr(model, "_no_split_modules", None) or [])]
    if not layers:
        return
    layer = max(sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in m.parameters()) for m in layers)
    limits = {"stage3_max_live_parameters": 2 * layer, "stage3_max_reuse_distance": 2 * layer,
              "stage3_prefetch_bucket_size": layer}
    set_here = {k: v for k, v in limits.items() if k not in zero}
    zero.update(set_here)
    if set_here and announce:
        print(f"selfdraft: ZeRO-3 keeps at most {2 * layer:,} gathered parameters alive and prefetches {layer:,} "
              "(two decoder layers and one; set stage3_max_live_parameters, stage3_max_reuse_distance and "
              "stage3_prefetch_bucket_size in a deepspeed_config_file to change it)", file=sys.stderr, flush=True)


def _partitioned_creation(accelerator):
    """Under ZeRO-3, models created inside are partitioned as they load (transformers' from_pretrained
    under deepspeed.zero.Init); a no-op otherwise."""
    if not _zero3(accelerator):
        return contextlib.nullcontext()
    return accelerator.state.deepspeed_plugin.zero3_init_context_manager(enable=True)


def _fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


@contextlib.contextmanager
def _persistent_buffers_hidden(accelerator, module):
    """Under FSDP, present persistent buffers (EAGLE-3's vocabulary maps) as non-persistent while
    accelerate prepares the module. Its fsdp_cpu_ram_efficient_loading broadcasts the state dict as if
    every entry were a sharded parameter (accelerate 1.15 fsdp2_load_full_state_dict fails with "'Tensor'
    object has no attribute 'device_mesh'"); non-persistent buffers it copies to every process itself."""
    hidden = []
    if _fsdp(accelerator):
        for m in module.modules():
            for name in m._buffers:
                if m._buffers[name] is not None and name not in m._non_persistent_buffers_set:
                    m._non_persistent_buffers_set.add(name)
                    hidden.append((m, name))
    try:
        yield
    finally:
        for m, name in hidden:
            m._non_persistent_buffers_set.discard(name)


def _resharded(accelerator, module) -> None:
    """Under FSDP, put every unit back in its sharded state: the root unit stays gathered after a
    forward without backward (evaluation), and its parameters are then not the optimizer's."""
    if _fsdp(accelerator):
        from torch.distributed.fsdp import FSDPModule

        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def _trainable_state(accelerator, module) -> dict[str, torch.Tensor]:
    """The trained tensors in full, on every process (a collective under ZeRO-3 and FSDP)."""
    from torch.distributed.tensor import DTensor

    _resharded(accelerator, module)
    with _full_parameters(accelerator, module):
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
                 for k, v in module.trainable_state_dict().items()}
    return state


def _optimizer_state(accelerator, model, optimizer) -> dict:
    """The optimizer's state to save on the main process: its own, or under FSDP its full state (every
    process's shards gathered) keyed by parameter name. All processes call it."""
    if not _fsdp(accelerator):
        return optimizer.state_dict()
    from torch.distributed.tensor import DTensor

    _resharded(accelerator, model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups, state = [], {}
    for group in optimizer.optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:  # the same order on every process: full_tensor() is a collective
            state[names[id(p)]] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
                                   if isinstance(v, torch.Tensor) else v
                                   for k, v in optimizer.optimizer.state.get(p, {}).items()}
    return {"param_groups": groups, "state": state}


def _load_optimizer_state(accelerator, model, optimizer, saved: dict) -> None:
    if not _fsdp(accelerator):
        optimizer.load_state_dict(saved)
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    _resharded(accelerator, model)
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    groups = optimizer.optimizer.param_groups
    if [g["params"] for g in saved["param_groups"]] != [[names[id(p)] for p in g["params"]] for g in groups]:
        raise SelfdraftError("the checkpoint's optimizer holds other parameters than this run's")
    for group, old in zip(groups, saved["param_groups"]):
        group.update({k: v for k, v in old.items() if k != "params"})
    for name, values in saved["state"].items():
        p = params[name]
        optimizer.optimizer.state[p] = {
            k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape else v
            for k, v in values.items()}


def _full_parameters(accelerator, module, modify: bool = False):
    """Under DeepSpeed ZeRO-3, gather the module's partitioned trainable parameters (all ranks must
    enter; the frozen target stays sharded); with ``modify``, rank 0's changes are partitioned back on
    exit. A no-op otherwise."""
    if not _zero3(accelerator):
        return contextlib.nullcontext()
    import deepspeed

    trainable = [p for p in module.parameters() if p.requires_grad]
    return deepspeed.zero.GatheredParameters(trainable, modifier_rank=0 if modify else None)


def _zero_state_dict(optimizer) -> dict:
    """A DeepSpeed ZeRO optimizer's state without its Python objects (static loss scaler, slice maps)."""
    state = dict(optimizer.state_dict())
    if state.get("dynamic_loss_scale"):
        raise SelfdraftError("fp16 dynamic loss scaling cannot be checkpointed without pickle: train in bf16 or fp32")
    state.pop("loss_scaler", None)
    state.pop("param_slice_mappings", None)
    return state


def _log(accelerator, out: pathlib.Path, step: int, metrics: dict[str, float], trackers: bool) -> None:
    if trackers:
        accelerator.log(metrics, step=step)
    if accelerator.is_main_process:
        with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


def _truncate_metrics(path: pathlib.Path, step: int) -> None:
    """Drop metric lines past ``step`` (written after the checkpoint a run resumes from)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text(encoding="utf-8").splitlines() if line and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)

