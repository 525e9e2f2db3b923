"""The one training loop, for every drafter kind, on one CPU or many GPUs through accelerate.

    accelerate launch -m selfdraft.train --config configs/medusa_smollm2.yaml train.lr=3e-4
    selfdraft train --config smoke_cpu                      # one process, same code

The run folder (``train.output_dir``) receives ``config.yaml`` (the resolved config), ``data/`` (the
rendered dataset, reused on resume), ``features/`` (with ``train.features: auto``, when a cache pays),
``checkpoints/step-N/`` (the last ``keep_last``), ``metrics.jsonl``, ``training.png`` (loss and
per-head accuracy curves), and at the end ``drafter/``: the native export, with a sparse tree built
from the measured accuracies.

:func:`train` reads in the order a run goes; each stage is a helper below it. Its neighbours hold the
rest: the data order and batches (``selfdraft.train.batches``: a pure function of seed and step, so a
resumed run sees exactly the batches the uninterrupted run would have seen), the number of steps
(``selfdraft.train.deadline``: ``train.max_steps``, or re-planned against ``train.time_budget_minutes``),
checkpoints (``selfdraft.train.checkpoint``: optimizer, scheduler, step plan and RNG states come back
from them) and everything that touches accelerate's, torch's or DeepSpeed's internals
(``selfdraft.train.distributed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import pathlib
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from selfdraft import __version__
from selfdraft.configs.run import RunConfig, upgrade_config_dict
from selfdraft.configs.schema import to_dict
from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds import get_kind
from selfdraft.train import checkpoint as ckpt
from selfdraft.train import distributed as dist
from selfdraft.train.batches import check_context, make_batch, prepare_data, step_batches, stream_index
from selfdraft.train.budget import resolve_features
from selfdraft.train.deadline import StepPlan, StepTimer, stopwatch
from selfdraft.train.export import drafter_record, evaluation_record, write_native
from selfdraft.train.distributed import fsdp as _fsdp  # the name train()'s Medusa-2 check reads
from selfdraft.train.features import FeatureSource, open_feature_cache
from selfdraft.train.profile import StepProfile

# Names that other modules and tests import from here, defined in the loop's neighbours now.
from selfdraft.train.batches import collate, pack_rows  # noqa: F401, E402
from selfdraft.train.distributed import resolve_mixed_precision  # noqa: F401, E402

logger = logging.getLogger(__name__)

# Keys whose change is allowed when resuming (they do not change what the finished run computes,
# or only extend it).
RESUMABLE_CHANGES = {"train.max_steps", "train.time_budget_minutes", "train.eval_every", "train.eval_batches",
                     "train.save_every", "train.keep_last", "train.log_every", "train.report_to", "train.wandb_project",
                     "train.wandb_mode", "train.num_threads", "train.features", "train.dist_timeout_minutes",
                     "train.data_dir", "train.render_processes"}


class TrainingDiverged(SelfdraftError):
    """The loss or the gradient norm became NaN/inf; the run stopped without saving."""


@dataclasses.dataclass
class TrainResult:
    output_dir: pathlib.Path
    step: int
    drafter_dir: pathlib.Path | None
    """The native export, written when the run reached its planned total of steps."""
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
    run_train_seconds: float = 0.0
    """Seconds spent in optimizer steps by the whole run, its earlier (resumed) calls included as far as
    their checkpoints recorded: what ``train.time_budget_minutes`` counts."""


def train(config: RunConfig, *, resume: bool | str | os.PathLike = False, stop_after: int | None = None,
          cpu: bool = False, step_timer: StepTimer = stopwatch) -> TrainResult:
    """Run (or resume) a training run; see the module docstring.

    ``resume``: True continues from the latest checkpoint of ``train.output_dir``, a path from that
    checkpoint. ``stop_after`` ends the run after that many optimizer steps without finishing it (as a
    crash would, but after a checkpoint). ``cpu`` trains on the CPU even where there is a GPU.
    ``step_timer`` times each optimizer step (``TrainResult.step_seconds``, and what a time budget
    re-plans from); tests script it."""
    from accelerate.utils import set_seed

    from selfdraft.train.objectives import build_objective

    kind = get_kind(config.drafter.kind)  # an unknown kind is refused before anything runs
    if kind.trains_target(config) and config.train.features:
        raise SelfdraftError(f"train.features: {kind.trains_target(config)}, so its features cannot be precomputed: "
                             "leave train.features empty")
    resume_from = _resume_point(config, resume)  # decided before anything is written
    config, source = _feature_source(config, cpu)  # train.features auto: a cache written now, or online
    t = config.train
    out = pathlib.Path(t.output_dir)
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    accelerator = _make_accelerator(config, out, cpu=cpu)
    world, main = accelerator.num_processes, accelerator.is_main_process
    if _fsdp(accelerator) and kind.trains_target(config):
        raise SelfdraftError(f"{kind.trains_target(config)}: such a run does not train under FSDP here, since its export "
                             "merges the adapters into a whole target. Use DeepSpeed ZeRO-3 "
                             "(configs/accelerate/deepspeed_zero3.yaml), which shards the target and is tested with it, "
                             "or keep the target frozen (e.g. drafter.medusa.lora.rank=0)")

    saved = _saved_state(resume_from, world)
    set_seed(t.seed)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False), encoding="utf-8")

    target = _load_target(config, accelerator)
    train_data, eval_data = _load_data(config, target.tokenizer, accelerator)
    objective = build_objective(config, target.model, train_data)
    dist.place_objective(accelerator, objective, target.model)
    cache, covered = _open_cache(config, source, target, objective.feature_layers, train_data, eval_data, accelerator)
    plan = StepPlan.for_run(t.max_steps, t.time_budget_minutes, saved.get("plan"), limit=covered)
    optimizer, scheduler = _optimizer(objective, config, plan)
    model, optimizer = _prepare(accelerator, config, objective, optimizer, target.model)
    run = _Run(config=config, accelerator=accelerator, model=model, unwrapped=accelerator.unwrap_model(model),
               optimizer=optimizer, scheduler=scheduler, plan=plan, train_data=train_data, eval_data=eval_data,
               cache=cache, pad_id=_pad_id(target.tokenizer), out=out, identity=target.identity)
    if resume_from is not None:
        _restore(run, resume_from)
    if t.report_to != "none":
        accelerator.init_trackers(t.wandb_project, config=_flatten(to_dict(config)),
                                  init_kwargs={"wandb": {"name": config.name, "dir": str(out), "mode": t.wandb_mode}})

    tally = _train_steps(run, stop_after, step_timer)
    finished = run.step == plan.total
    if finished:
        _export(run, target)
    if main:
        from selfdraft.train.plots import plot_metrics

        plot_metrics(out / "metrics.jsonl", out / "training.png")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return TrainResult(output_dir=out, step=run.step, drafter_dir=out / "drafter" if finished else None,
                       last_eval=run.last_eval, train_tokens_per_second=tally.tokens / max(tally.seconds, 1e-9),
                       train_seconds=tally.seconds, step_seconds=tally.step_seconds,
                       target_seconds=tally.phases.seconds.get("target forward", 0.0), objective=run.unwrapped,
                       run_train_seconds=plan.spent_seconds)


@dataclasses.dataclass
class _Run:
    """A prepared run: what the steps, the evaluations and the checkpoints share, and where it stands."""

    config: RunConfig
    accelerator: Any
    model: Any
    """What ``accelerator.prepare`` returned (a DDP, DeepSpeed or FSDP wrapper, or the objective)."""
    unwrapped: Any
    """The objective inside ``model``."""
    optimizer: Any
    scheduler: Any
    plan: StepPlan
    train_data: list
    eval_data: list
    cache: Any
    """The feature cache streamed instead of the target's forward; None: online features."""
    pad_id: int
    out: pathlib.Path
    step: int = 0
    """Optimizer steps done."""
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    rank_acc: torch.Tensor | None = None
    """Held-out accuracy by depth and rank (K, R) of the last evaluation: the sparse tree's input."""
    identity: Any = None
    """The target's :class:`~selfdraft.heads.target.TargetIdentity`, recorded with every checkpoint."""

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters being trained, as prepare() left them (FSDP2 replaces them with DTensors)."""
        return [p for p in self.model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------------------------
# Before the run: resume point, feature source, accelerator, target, data, cache, optimizer


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _config_changes(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _resume_point(config: RunConfig, resume: bool | str | os.PathLike) -> pathlib.Path | None:
    """The checkpoint the run continues from (None: a new run), checked against ``config``: only
    :data:`RESUMABLE_CHANGES` may differ. A new run refuses a folder that holds checkpoints."""
    root = pathlib.Path(config.train.output_dir) / "checkpoints"
    if not resume:
        if ckpt.latest_checkpoint(root) is not None:
            raise SelfdraftError(f"{config.train.output_dir} already holds checkpoints: pass --resume to continue that "
                                 "run, or set train.output_dir to a new folder")
        return None
    folder = pathlib.Path(resume) if not isinstance(resume, bool) else ckpt.latest_checkpoint(root)
    if folder is None:
        raise SelfdraftError(f"--resume: {root} has no complete checkpoint to resume from")
    saved, _ = upgrade_config_dict(ckpt.read_state(folder)["config"])  # checkpoints of 0.1 name the tree elsewhere
    changes = [k for k in _config_changes(saved, to_dict(config)) if k not in RESUMABLE_CHANGES]
    if changes:
        raise SelfdraftError(f"cannot resume {folder} with a different config: {', '.join(changes)} changed")
    return folder


def _saved_state(folder: pathlib.Path | None, world: int) -> dict[str, Any]:
    """The ``state.json`` of the checkpoint a run resumes from ({} for a new run), which must have
    been written by as many processes as this run has."""
    if folder is None:
        return {}
    state = ckpt.read_state(folder)
    if state["world_size"] != world:
        raise SelfdraftError(f"{folder} was written by {state['world_size']} processes, this run has {world}; "
                             "resume with the same number (the data order depends on it)")
    return state


def _feature_source(config: RunConfig, cpu: bool) -> tuple[RunConfig, FeatureSource]:
    """``train.features`` as a typed source, with ``auto`` decided now (``budget.resolve_features``:
    a cache written or found in ``output_dir/features``, or online); the config then names the choice.
    It comes before the run's accelerator: writing a cache runs one of its own."""
    if FeatureSource.parse(config.train.features).kind == "auto":
        config = resolve_features(config, cpu=cpu)
    return config, FeatureSource.parse(config.train.features)


def _make_accelerator(config: RunConfig, out: pathlib.Path, cpu: bool = False):
    """The run's accelerator: its process group (``dist.process_group_handlers``), mixed precision
    (``train.mixed_precision``; unset takes accelerate's config file or launch flag, else no), the
    wandb tracker, and FSDP2 on CPUs where accelerate was launched with an FSDP config there."""
    from accelerate import Accelerator

    t = config.train
    handlers = dist.process_group_handlers(t.dist_timeout_minutes)
    fsdp_on_cpu = dist.fsdp_on_cpu_requested()
    if not dist.launched():
        dist.fresh_accelerate_state()
    accelerator = Accelerator(mixed_precision=dist.resolve_mixed_precision(t.mixed_precision, cpu),
                              gradient_accumulation_steps=t.grad_accum,
                              log_with="wandb" if t.report_to == "wandb" else None, project_dir=str(out),
                              kwargs_handlers=handlers, cpu=cpu or fsdp_on_cpu)
    if fsdp_on_cpu:
        dist.run_fsdp2_on_cpu(accelerator)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and accelerator.distributed_type.name != "DEEPSPEED":
        raise SelfdraftError("accelerate was launched with a DeepSpeed config but runs without DeepSpeed (ACCELERATE_USE_CPU "
                             "or --cpu turns it off): unset it; on CPUs set DS_ACCELERATOR=cpu instead")
    if accelerator.is_main_process:
        source = {None: "accelerate's config", "auto": f"train.mixed_precision auto, {dist.bf16_reason(cpu)}"}.get(
            t.mixed_precision, "train.mixed_precision")
        logger.info("mixed precision %s (from %s) on %s", accelerator.mixed_precision, source, accelerator.device)
    return accelerator


def _load_target(config: RunConfig, accelerator):
    """The frozen target, loaded by every process at once. Under ZeRO-3 it is created partitioned
    (deepspeed.zero.Init, whatever zero3_init_flag says): each process keeps its shard of every
    weight, never the whole model, and the loading collectives need all processes. Under FSDP it stays
    in CPU memory until prepare() shards it."""
    from selfdraft.heads.target import load_target, target_folder
    from selfdraft.machine import peak_resident_bytes
    from selfdraft.train.partitioned import load_partitioned

    # A built-in target is converted once per node (its cache is usually node-local; on a shared one the
    # conversion is atomic, so two nodes converting at once waste time, nothing else).
    with accelerator.local_main_process_first():
        target_folder(config.target.spec)
    with dist.partitioned_creation(accelerator):
        target = load_target(config.target.spec, dtype=config.target.dtype, device=dist.target_load_device(accelerator),
                             trust_remote_code=config.target.trust_remote_code,
                             model_loader=load_partitioned if dist.zero3(accelerator) else None,
                             small_batch_kernel=False)  # training never verifies a tree: no few-row kernel, no timing of it
    if target.tokenizer is None:
        raise SelfdraftError(f"target {config.target.spec} has no tokenizer: training needs its chat template")
    check_context(config, target.max_context)
    if accelerator.is_main_process:
        peak = peak_resident_bytes()
        peak = f" (peak resident memory of this process so far: {peak / 1e9:.2f} GB)" if peak else ""
        if dist.zero3(accelerator):
            held, whole = dist.held_by_this_process(accelerator, target.model)
            logger.info("ZeRO-3 created the target partitioned: this process holds %s of its %s parameters%s",
                        f"{held:,}", f"{whole:,}", peak)
        else:
            logger.info("loaded the target%s", peak)
    return target


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _load_data(config: RunConfig, tokenizer, accelerator) -> tuple[list, list]:
    """The rendered train/eval split (``batches.prepare_data``), big enough for every process."""
    t, world = config.train, accelerator.num_processes
    train_data, eval_data = prepare_data(config, tokenizer, accelerator)
    if not eval_data:
        raise SelfdraftError("the held-out split is empty: raise data.eval_fraction or give more conversations")
    if len(train_data) < world * t.micro_batch_size:  # every process sees the same split: all raise
        raise SelfdraftError(f"{world} processes x train.micro_batch_size {t.micro_batch_size} need at least "
                             f"{world * t.micro_batch_size} training conversations, the split has {len(train_data)}: "
                             "launch fewer processes or give more data (data.max_conversations)")
    return train_data, eval_data


def _open_cache(config: RunConfig, source: FeatureSource, target, layers: list[int], train_data: list, eval_data: list,
                accelerator):
    """(the feature cache the run streams, the most steps it covers): (None, None) with online features.
    A run of ``train.max_steps`` needs every example its steps visit; a run under a time budget plans
    its steps up to what the cache covers (None: all of the split, any number of steps)."""
    if source.kind != "cache":
        return None, None
    t = config.train
    cache = open_feature_cache(config, target, layers)
    G = t.micro_batch_size * t.grad_accum * accelerator.num_processes
    covered = cache.steps_covered(len(train_data), G, t.seed) if t.time_budget_minutes else None
    if not t.time_budget_minutes or covered == 0:
        cache.check_covers("train", {stream_index(p, len(train_data), t.seed) for p in range(t.max_steps * G)})
    cache.check_covers("eval", range(len(eval_data)))
    if accelerator.is_main_process:
        print(f"streaming the target's features from {source.path}")
    return cache, covered


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _optimizer(objective, config: RunConfig, plan: StepPlan):
    """AdamW over the trainable parameters, and its schedule. The cosine ends at the plan's total as it
    stands when each step begins: a re-plan re-targets the rest of it (``selfdraft.train.deadline``)."""
    t = config.train
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=t.lr,
                                  betas=tuple(t.betas), weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, plan.total, t.min_lr_ratio))
    return optimizer, scheduler


def _prepare(accelerator, config: RunConfig, objective, optimizer, target_model):
    """accelerate's prepare() of the objective and its optimizer, as each strategy needs it."""
    dist.configure_deepspeed(accelerator, config.train, target_model, announce=accelerator.is_main_process)
    with dist.persistent_buffers_hidden(accelerator, objective):
        model, optimizer = accelerator.prepare(objective, optimizer)
    if dist.fsdp(accelerator) and accelerator.is_main_process:
        held, whole = dist.held_by_this_process(accelerator, accelerator.unwrap_model(model).target)
        logger.info("FSDP sharded the target: this process holds %s of its %s parameters", f"{held:,}", f"{whole:,}")
    return model, optimizer


def _restore(run: _Run, folder: pathlib.Path) -> None:
    """Continue ``run`` from checkpoint ``folder``: weights, optimizer, scheduler, RNG, where it stood."""
    state = ckpt.restore_checkpoint(run.accelerator, folder, model=run.model, unwrapped=run.unwrapped,
                                    optimizer=run.optimizer)
    run.scheduler.load_state_dict(state["scheduler"])
    run.step, run.last_eval = state["step"], state.get("last_eval", {})
    run.rank_acc = torch.tensor(state["rank_accuracy"]) if state.get("rank_accuracy") else None
    if run.accelerator.is_main_process:
        _truncate_metrics(run.out / "metrics.jsonl", run.step)
        print(f"resuming from {folder} at step {run.step}")


# ----------------------------------------------------------------------------------------------
# The steps


@dataclasses.dataclass
class _Tally:
    """What the steps of one call add up to, and the training statistics since the last log line."""

    phases: StepProfile
    tokens: float = 0.0
    seconds: float = 0.0
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    window: dict[str, torch.Tensor] | None = None
    window_steps: int = 0


def _train_steps(run: _Run, stop_after: int | None, step_timer: StepTimer) -> _Tally:
    """Optimizer steps until the plan's total (or ``stop_after``), with the log lines, evaluations and
    checkpoints on their schedule; the plan re-planned after every step."""
    t, accelerator = run.config.train, run.accelerator
    main = accelerator.is_main_process
    tally = _Tally(StepProfile(accelerator.device, only={"target forward"}))  # what a feature cache would save
    progress = tqdm(total=run.plan.total, initial=run.step, desc=f"training {run.config.name}", unit="step",
                    disable=not main or None)
    run.model.train()
    while run.step < _end(run.plan, stop_after):
        stop = step_timer()
        stats, tokens, grad_norm = _optimizer_step(run, tally.phases)
        seconds = stop()
        run.step += 1
        done = run.step
        run.plan.record(done, _slowest(accelerator, seconds) if run.plan.budget_seconds is not None else seconds)
        run.scheduler.step()  # the next step's learning rate, for the total just planned
        tally.tokens += float(accelerator.reduce(tokens, reduction="sum"))
        tally.step_seconds.append(seconds)
        tally.seconds += seconds
        tally.window, tally.window_steps = _add_stats(tally.window, stats), tally.window_steps + 1
        progress.total = run.plan.total
        progress.update(1)
        end = _end(run.plan, stop_after)
        if done % t.log_every == 0 or done == end:
            metrics = _train_metrics(run, tally, grad_norm)
            progress.set_postfix(loss=f"{metrics['train/loss']:.3f}", top1=f"{metrics.get('train/top1/head0', 0):.2f}")
            _log(accelerator, run.out, done, metrics, t.report_to != "none")
        if (t.eval_every and done % t.eval_every == 0) or done == run.plan.total:
            run.last_eval, run.rank_acc = evaluate(run.model, run.eval_data, run.config, accelerator, run.pad_id, run.cache)
            _log(accelerator, run.out, done, run.last_eval, t.report_to != "none")
            if main:
                progress.write(f"step {done}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in run.last_eval.items()
                                                           if "top1" in k or "loss" in k))
        if (t.save_every and done % t.save_every == 0) or done == end:
            _save(run)
    progress.close()
    return tally


def _end(plan: StepPlan, stop_after: int | None) -> int:
    """The step this call stops after: the plan's total, or ``stop_after`` before it."""
    return plan.total if stop_after is None else min(plan.total, stop_after)


def _slowest(accelerator, seconds: float) -> float:
    """The longest of every process's step time, the same on all: their plans must agree."""
    if accelerator.num_processes == 1:
        return seconds
    return float(accelerator.gather(torch.tensor([seconds], device=accelerator.device)).max())


def _optimizer_step(run: _Run, phases: StepProfile) -> tuple[dict[str, torch.Tensor], torch.Tensor, Any]:
    """One optimizer step, over ``train.grad_accum`` micro batches: (their statistics summed, with the
    loss; this process's tokens; the gradient norm when it was clipped). A non-finite loss or gradient
    norm on any process stops the run on all of them."""
    t, accelerator, model, optimizer = run.config.train, run.accelerator, run.model, run.optimizer
    world, root = accelerator.num_processes, run.out / "checkpoints"
    tokens = torch.zeros((), device=accelerator.device)
    summed, grad_norm = None, None
    for micro, batch in enumerate(step_batches(run.train_data, run.step, accelerator.process_index, run.config, world,
                                               run.pad_id, accelerator.device, run.cache)):
        with accelerator.accumulate(model), accelerator.autocast():
            with phases.recording():
                loss, stats = model(**batch)
            finite = accelerator.reduce(torch.isfinite(loss.detach()).float().reshape(1), reduction="sum")
            if float(finite) < world:
                raise TrainingDiverged(
                    f"the loss became {float(loss.detach())} at step {run.step + 1} (micro batch {micro}); stopped without "
                    f"saving. Last good checkpoint: {ckpt.latest_checkpoint(root) or 'none yet'}. Lower train.lr or check the data.")
            accelerator.backward(loss)
            grad_norm = None
            if accelerator.sync_gradients and t.max_grad_norm > 0:
                grad_norm = accelerator.clip_grad_norm_(run.trainable, t.max_grad_norm)
            if grad_norm is not None and not math.isfinite(float(grad_norm)):
                raise TrainingDiverged(f"the gradient norm became {float(grad_norm)} at step {run.step + 1}; stopped "
                                       f"without saving. Last good checkpoint: {ckpt.latest_checkpoint(root) or 'none yet'}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        tokens += batch["attention_mask"].sum()
        summed = _add_stats(summed, {**stats, "loss": loss.detach().float().reshape(1)})
    return summed, tokens, grad_norm


def _add_stats(total: dict | None, stats: dict) -> dict:
    if total is None:
        return {k: v.detach().clone() for k, v in stats.items()}
    for k, v in stats.items():
        total[k] = total[k] + v.detach() if k in total else v.detach().clone()
    return total


def _train_metrics(run: _Run, tally: _Tally, grad_norm) -> dict[str, float]:
    """The log line of the steps since the last one (summed over processes), and empties the window."""
    from selfdraft.train.objectives import summarise

    t, accelerator = run.config.train, run.accelerator
    window = {k: accelerator.reduce(v, reduction="sum") for k, v in sorted(tally.window.items())}
    metrics = {"train/loss": float(window["loss"].sum()) / (t.grad_accum * accelerator.num_processes * tally.window_steps),
               **{f"train/{k}": v for k, v in summarise(window).items()},
               "lr": run.scheduler.get_last_lr()[0], "tokens_per_second": tally.tokens / max(tally.seconds, 1e-9)}
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    tally.window, tally.window_steps = None, 0
    return metrics


# ----------------------------------------------------------------------------------------------
# Evaluation, checkpoints, export


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
    metrics["eval/predicted_tau"] = accelerator.unwrap_model(objective).predicted_tau(accuracy)
    return metrics, accuracy


def _save(run: _Run) -> pathlib.Path:
    """Checkpoint the run where it stands (every process calls it)."""
    evaluation = evaluation_record(run.last_eval, run.step, run.config.train.top_k)
    record = drafter_record(run.unwrapped, run.config, run.identity, run.rank_acc, evaluation)
    state = {"scheduler": run.scheduler.state_dict(), "plan": run.plan.state(), "last_eval": run.last_eval,
             "rank_accuracy": run.rank_acc.tolist() if run.rank_acc is not None else None, "config": to_dict(run.config),
             "selfdraft_version": __version__, "drafter": record.to_config(), "drafter_prefix": run.unwrapped.drafter_name()}
    return ckpt.save_checkpoint(run.accelerator, run.out / "checkpoints", run.step, model=run.model, unwrapped=run.unwrapped,
                                optimizer=run.optimizer, state=state, keep_last=run.config.train.keep_last)


def _export(run: _Run, target) -> None:
    """Write the finished run's native drafter (``drafter/``), with its last evaluation."""
    accelerator, unwrapped, config = run.accelerator, run.unwrapped, run.config
    state = dist.trainable_state(accelerator, unwrapped)  # all processes: a collective under ZeRO-3 and FSDP
    # Medusa-2 merges its LoRA weights into the target: under ZeRO-3 they must be gathered for that.
    with dist.full_parameters(accelerator, unwrapped) if unwrapped.lora else contextlib.nullcontext():
        if accelerator.is_main_process:
            evaluation = evaluation_record(run.last_eval, run.step, config.train.top_k)
            folder = write_native(unwrapped, config, target, run.rank_acc, run.out / "drafter", evaluation, state)
            print(f"wrote the drafter to {folder}")


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
