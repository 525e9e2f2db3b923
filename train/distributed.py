"""The one place where training reaches into accelerate's, torch's and DeepSpeed's internals.

The loop runs one process or many (DDP, DeepSpeed ZeRO-2/3, FSDP2) through accelerate; what
accelerate does not offer as public API is done here, and every touch of a private name or of an
undocumented behaviour says which version it was written against (accelerate 1.15.0, read again in
1.16.0; torch 2.13.0; deepspeed 0.19.8). After upgrading one of them, read the ``# private:`` and
version comments of this file first.

* the accelerator's set-up: the process group over gloo on CPUs, mixed precision, accelerate's global
  state between two runs in one process, FSDP2 on CPUs (:func:`run_fsdp2_on_cpu`);
* ZeRO-3: the target created partitioned, the limits on gathered parameters, trainable weights
  gathered for saving and loading;
* FSDP2: the auto-wrap units, persistent buffers while preparing, resharding, the optimizer state
  gathered and redistributed by parameter name;
* checkpointable optimizer states (ZeRO's partitions without their Python objects).

Every function that is a collective under a sharded strategy says so: all processes must call it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os

import torch

from selfdraft.errors import SelfdraftError

logger = logging.getLogger(__name__)


def launched() -> bool:
    """Whether a launcher (accelerate launch, torchrun) started several processes of this run."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def process_group_handlers(timeout_minutes: float) -> list:
    """accelerate ``kwargs_handlers`` for a launched run: its collectives give up after
    ``timeout_minutes``, and processes without GPUs talk over gloo (DeepSpeed on CPUs needs it said
    explicitly). Empty for a single process, which has no process group."""
    from accelerate.utils import InitProcessGroupKwargs

    if not launched():
        return []
    timeout = datetime.timedelta(minutes=timeout_minutes)
    return [InitProcessGroupKwargs(timeout=timeout, **({} if torch.cuda.is_available() else {"backend": "gloo"}))]


def trains_on_gpu(cpu: bool = False) -> bool:
    """Whether accelerate will put the run on a GPU: there is one and neither ``cpu`` nor the
    launcher's ACCELERATE_USE_CPU asks for the CPU."""
    return (torch.cuda.is_available() and not cpu
            and os.environ.get("ACCELERATE_USE_CPU", "false").lower() != "true")


def resolve_mixed_precision(value: str | None, cpu: bool = False) -> str | None:
    """``train.mixed_precision`` as accelerate takes it: ``auto`` becomes bf16 where the hardware
    multiplies bf16 natively (a CUDA GPU that supports it; a CPU with AVX-512 BF16 or AMX), else no.
    ``cpu``: the run stays on the CPU even where there is a GPU."""
    if value != "auto":
        return value
    if trains_on_gpu(cpu):
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    from selfdraft.machine import cpu_has_bf16

    return "bf16" if cpu_has_bf16() else "no"


def bf16_reason(cpu: bool = False) -> str:
    """What ``train.mixed_precision: auto`` decided from, for the log."""
    from selfdraft.machine import cpu_flags

    return "a GPU" if trains_on_gpu(cpu) else f"CPU flags {' '.join(cpu_flags()) or 'unknown'}"


def fresh_accelerate_state() -> None:
    """Forget accelerate's process-wide state, so that a second run in the same Python process (the
    quickstart's calibration and then its run, a sweep, a notebook) may choose another mixed
    precision; accelerate refuses that otherwise ("AcceleratorState has already been initialized").
    Only for a process that no launcher started: that run owns it, and starts as a new process would."""
    from accelerate.state import AcceleratorState

    # private: AcceleratorState._reset_state (accelerate 1.15.0; "should not be called" says its
    # docstring): it clears the shared state of AcceleratorState and, with the flag, PartialState's.
    AcceleratorState._reset_state(reset_partial_state=True)


def fsdp_on_cpu_requested() -> bool:
    """A launch with an FSDP config on machines without GPUs. accelerate (1.15.0) selects FSDP only on
    accelerators: its processes would run unsharded and unsynchronised. :func:`run_fsdp2_on_cpu`
    makes them FSDP2 processes over gloo instead."""
    return launched() and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not torch.cuda.is_available()


def run_fsdp2_on_cpu(accelerator) -> None:
    """Switch an accelerator built with ``cpu=True`` (processes over gloo) to FSDP2, so that
    ``prepare()`` shards with FSDP2 exactly as it does on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise SelfdraftError("FSDP on CPUs runs FSDP2 only: set fsdp_version: 2 in the accelerate config")
    # private: AcceleratorState's distributed_type and fsdp_plugin are set by its __init__ only
    # (accelerate 1.15.0); assigning them afterwards is what its __init__ would have done for FSDP.
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    # private: PartialState._shared_state (accelerate 1.15.0): AcceleratorState.__init__ copies its
    # distributed_type there at the end; PartialState's users (gather, reduce) read it from there.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if accelerator.is_main_process:
        logger.info("accelerate's FSDP config on CPUs: FSDP2 over gloo")


# ----------------------------------------------------------------------------------------------
# Which strategy


def deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def zero3(accelerator) -> bool:
    return deepspeed(accelerator) and accelerator.state.deepspeed_plugin.zero_stage == 3


def fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


# ----------------------------------------------------------------------------------------------
# Creating and preparing the modules


def partitioned_creation(accelerator):
    """Under ZeRO-3, models created inside are partitioned as they load (transformers' from_pretrained
    under deepspeed.zero.Init); a no-op otherwise."""
    if not zero3(accelerator):
        return contextlib.nullcontext()
    return accelerator.state.deepspeed_plugin.zero3_init_context_manager(enable=True)


def target_load_device(accelerator) -> str:
    """Where the target's weights are loaded: under FSDP the CPU, until prepare() shards them onto the
    device (with accelerate's fsdp_cpu_ram_efficient_loading, only local rank 0 reads the weights; the
    others hold it on meta); else the run's device."""
    return "cpu" if fsdp(accelerator) else str(accelerator.device)


def held_by_this_process(accelerator, module: torch.nn.Module) -> tuple[int, int] | None:
    """(parameters this process holds, parameters in all) of a sharded module; None unsharded. Under
    ZeRO-3 before or after prepare(), under FSDP after it."""
    from torch.distributed.tensor import DTensor

    weights = list(module.parameters())
    if zero3(accelerator):
        # DeepSpeed 0.19.8 partitioned parameters: ds_tensor is this process's part, ds_numel the whole.
        return sum(p.ds_tensor.numel() for p in weights), sum(p.ds_numel for p in weights)
    if fsdp(accelerator):
        return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in weights), sum(p.numel() for p in weights)
    return None


def place_objective(accelerator, objective: torch.nn.Module, target_model: torch.nn.Module) -> None:
    """Put the objective where prepare() expects it. Under FSDP it stays on the CPU and auto-wraps
    each of the target's decoder layers as an FSDP unit. The root unit holds the drafter with the
    target's embedding, final norm and LM head, which the losses read outside any layer's forward (a
    drafter layer of the target's class is a unit of its own, used in its forward only)."""
    if fsdp(accelerator):
        # accelerate 1.15.0's FSDP2 auto-wrap policy reads the class names to wrap from the root
        # module's _no_split_modules (transformers' convention for its models).
        objective._no_split_modules = list(getattr(target_model, "_no_split_modules", None) or [])
    else:
        objective.to(accelerator.device)


def configure_deepspeed(accelerator, train_config, target_model: torch.nn.Module, announce: bool) -> None:
    """Fill the DeepSpeed config accelerate will hand to ``deepspeed.initialize`` in prepare(): the
    run's micro batch and clipping, and under ZeRO-3 :func:`bound_live_parameters`. A no-op without
    DeepSpeed."""
    if not deepspeed(accelerator):
        return
    # accelerate 1.15.0 passes deepspeed_plugin.deepspeed_config (a dict) to deepspeed.initialize in
    # prepare(); entries written before prepare() take effect.
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = train_config.micro_batch_size
    ds["gradient_clipping"] = train_config.max_grad_norm
    if zero3(accelerator):
        bound_live_parameters(ds.setdefault("zero_optimization", {}), target_model, announce)


def bound_live_parameters(zero: dict, model: torch.nn.Module, announce: bool) -> None:
    """ZeRO-3 limits a DeepSpeed config file leaves unset: at most two of the target's decoder layers
    stay gathered between uses, and one layer's worth is prefetched (DeepSpeed's 5e7 elements would
    prefetch several layers of a small target). DeepSpeed's default (1e9 parameters, 1e9 distance)
    keeps a whole target of that size gathered on every process once it has run; the frozen target
    never needs its weights again in the backward, so releasing them after each layer costs no extra
    gather."""
    layers = [m for m in model.modules() if type(m).__name__ in set(getattr(model, "_no_split_modules", None) or [])]
    if not layers:
        return
    layer = max(sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in m.parameters()) for m in layers)
    limits = {"stage3_max_live_parameters": 2 * layer, "stage3_max_reuse_distance": 2 * layer,
              "stage3_prefetch_bucket_size": layer}
    set_here = {k: v for k, v in limits.items() if k not in zero}
    zero.update(set_here)
    if set_here and announce:
        logger.info("ZeRO-3 keeps at most %s gathered parameters alive and prefetches %s (two decoder layers and one; "
                    "set stage3_max_live_parameters, stage3_max_reuse_distance and stage3_prefetch_bucket_size in a "
                    "deepspeed_config_file to change it)", f"{2 * layer:,}", f"{layer:,}")


@contextlib.contextmanager
def persistent_buffers_hidden(accelerator, module: torch.nn.Module):
    """Under FSDP, present persistent buffers (EAGLE-3's vocabulary maps) as non-persistent while
    accelerate prepares the module. Its fsdp_cpu_ram_efficient_loading broadcasts the state dict as if
    every entry were a sharded parameter (accelerate 1.15.0 fsdp2_load_full_state_dict fails with
    "'Tensor' object has no attribute 'device_mesh'"); non-persistent buffers it copies to every
    process itself."""
    hidden = []
    if fsdp(accelerator):
        for m in module.modules():
            # private: nn.Module._buffers and _non_persistent_buffers_set (torch 2.13.0): the set of
            # buffer names that state_dict() leaves out; register_buffer(persistent=False) fills it.
            for name in m._buffers:
                if m._buffers[name] is not None and name not in m._non_persistent_buffers_set:
                    m._non_persistent_buffers_set.add(name)
                    hidden.append((m, name))
    try:
        yield
    finally:
        for m, name in hidden:
            m._non_persistent_buffers_set.discard(name)


# ----------------------------------------------------------------------------------------------
# Full tensors from shards, for saving, exporting and resuming


def resharded(accelerator, module: torch.nn.Module) -> None:
    """Under FSDP, put every unit back in its sharded state: the root unit stays gathered after a
    forward without backward (evaluation), and its parameters are then not the optimizer's."""
    if fsdp(accelerator):
        from torch.distributed.fsdp import FSDPModule

        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def full_parameters(accelerator, module: torch.nn.Module, modify: bool = False):
    """Under DeepSpeed ZeRO-3, gather the module's partitioned trainable parameters (all processes
    must enter; the frozen target stays sharded); with ``modify``, rank 0's changes are partitioned
    back on exit. A no-op otherwise."""
    if not zero3(accelerator):
        return contextlib.nullcontext()
    import deepspeed as ds

    trainable = [p for p in module.parameters() if p.requires_grad]
    return ds.zero.GatheredParameters(trainable, modifier_rank=0 if modify else None)


def trainable_state(accelerator, module) -> dict[str, torch.Tensor]:
    """The trained tensors in full, on every process (a collective under ZeRO-3 and FSDP)."""
    from torch.distributed.tensor import DTensor

    resharded(accelerator, module)
    with full_parameters(accelerator, module):
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
                 for k, v in module.trainable_state_dict().items()}
    return state


def optimizer_state(accelerator, model, optimizer) -> dict:
    """The optimizer's state to save on the main process: its own, or under FSDP its full state (every
    process's shards gathered) keyed by parameter name. All processes call it."""
    if not fsdp(accelerator):
        return optimizer.state_dict()
    from torch.distributed.tensor import DTensor

    resharded(accelerator, model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups, state = [], {}
    # accelerate 1.15.0's AcceleratedOptimizer keeps the torch optimizer it wraps as .optimizer.
    for group in optimizer.optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:  # the same order on every process: full_tensor() is a collective
            state[names[id(p)]] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
                                   if isinstance(v, torch.Tensor) else v
                                   for k, v in optimizer.optimizer.state.get(p, {}).items()}
    return {"param_groups": groups, "state": state}


def load_optimizer_state(accelerator, model, optimizer, saved: dict) -> None:
    """The inverse of :func:`optimizer_state`: under FSDP each process takes its shards of the full
    state. All processes call it."""
    if not fsdp(accelerator):
        optimizer.load_state_dict(saved)
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    resharded(accelerator, model)
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


def zero_state_dict(optimizer) -> dict:
    """A DeepSpeed ZeRO optimizer's state (this process's partition) without its Python objects."""
    state = dict(optimizer.state_dict())
    # deepspeed 0.19.8 (runtime/zero/stage_1_and_2.py state_dict): "loss_scaler" is a LossScaler
    # object and "param_slice_mappings" a dict of fragment objects; neither goes into safetensors/JSON.
    if state.get("dynamic_loss_scale"):
        raise SelfdraftError("fp16 dynamic loss scaling cannot be checkpointed without pickle: train in bf16 or fp32")
    state.pop("loss_scaler", None)
    state.pop("param_slice_mappings", None)
    return state


def load_zero_state_dicts(model, parts: list[dict]) -> None:
    """Give the DeepSpeed engine ``model`` every process's saved partition (each process reads all:
    ZeRO re-partitions them); the inverse of :func:`zero_state_dict`."""
    for part in parts:  # the static loss scaler zero_state_dict left out: the engine's own
        part.setdefault("loss_scaler", model.optimizer.loss_scaler)
    # deepspeed 0.19.8: load_from_fp32_weights takes the fp32 master weights from the saved state
    # rather than from the model, as a resumed run needs.
    model.optimizer.load_state_dict(parts, load_from_fp32_weights=True)
