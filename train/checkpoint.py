"""Training checkpoints without pickle: safetensors for tensors, JSON for everything else.

A checkpoint is a folder ``checkpoints/step-00000100/`` holding

* ``trainable.safetensors``: the parameters being trained (heads, LoRA weights);
* ``optimizer.safetensors`` + ``optimizer.json``: the optimizer state, its tensors by path;
* ``rng-rank{r}.safetensors`` + ``rng-rank{r}.json``: every RNG of process r;
* ``state.json`` (written last): step, scheduler state, the step plan (``selfdraft.train.deadline``),
  seconds trained, last evaluation, the resolved run config.

Folders are written under a temporary name and renamed into place, so a crash never leaves a
half-written checkpoint under a final name; :func:`latest_checkpoint` only returns complete ones.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import shutil
from typing import Any

import numpy as np
import torch

from selfdraft.errors import SelfdraftError
from selfdraft.files import as_if_created
from selfdraft.heads.io import read_weights
from selfdraft.train import distributed as dist

STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def encode_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """JSON-able form of nested dicts/lists/tuples/scalars, with tensors and arrays moved into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous()
        return {"$tensor": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(obj))
        return {"$ndarray": path}
    if isinstance(obj, dict):
        return {"$dict": [[encode_tree(k, tensors, f"{path}.k{i}"), encode_tree(v, tensors, f"{path}.{i}")]
                          for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        items = [encode_tree(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
        return {"$tuple": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise SelfdraftError(f"cannot checkpoint a {type(obj).__name__} at {path or 'the top'}")


def decode_tree(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [decode_tree(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "$tensor" in obj:
            return tensors[obj["$tensor"]]
        if "$ndarray" in obj:
            return tensors[obj["$ndarray"]].numpy()
        if "$tuple" in obj:
            return tuple(decode_tree(v, tensors) for v in obj["$tuple"])
        return {decode_tree(k, tensors): decode_tree(v, tensors) for k, v in obj["$dict"]}
    return obj


def save_tree(folder: pathlib.Path, stem: str, obj: Any) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode_tree(obj, tensors)
    save_file(tensors, str(folder / f"{stem}.safetensors"))
    (folder / f"{stem}.json").write_text(json.dumps(skeleton), encoding="utf-8")


def load_tree(folder: pathlib.Path, stem: str) -> Any:
    path = folder / f"{stem}.json"
    if not path.is_file():
        raise SelfdraftError(f"checkpoint {folder} has no {path.name}: it is incomplete")
    try:
        skeleton = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise SelfdraftError(f"{path} is corrupt ({err})") from err
    return decode_tree(skeleton, read_weights(folder / f"{stem}.safetensors"))


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / f"step-{step:08d}"


def list_checkpoints(root: pathlib.Path) -> list[pathlib.Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: pathlib.Path) -> pathlib.Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_state(folder: pathlib.Path) -> dict[str, Any]:
    path = folder / STATE_FILE
    if not path.is_file():
        raise SelfdraftError(f"{folder} is not a complete checkpoint: it has no {STATE_FILE}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise SelfdraftError(f"{path} is corrupt ({err})") from err


def staging_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    """The temporary folder a checkpoint is written into before :func:`publish` renames it."""
    return root / f".step-{step:08d}.tmp"


def publish(root: pathlib.Path, step: int, state: dict[str, Any], keep_last: int) -> pathlib.Path:
    """Write ``state.json`` into the staging folder, rename it into place, prune old checkpoints."""
    work, final = staging_dir(root, step), checkpoint_dir(root, step)
    (work / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    as_if_created(work)
    if final.exists():
        shutil.rmtree(final)
    os.rename(work, final)
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------
# A prepared run's checkpoint (every process calls these: they are collectives when sharded)


def save_checkpoint(accelerator, root: pathlib.Path, step: int, *, model, unwrapped, optimizer,
                    state: dict[str, Any], keep_last: int) -> pathlib.Path:
    """Write checkpoint ``step`` of a prepared run under ``root`` and return its folder: the trained
    tensors in full (main process), the optimizer state (under DeepSpeed every process's own
    partition, else the main process's full state), every process's RNG, and last ``state`` (with
    ``world_size`` and ``sharded_optimizer`` added) as ``state.json``. ``model`` is what
    ``accelerator.prepare`` returned, ``unwrapped`` the module inside it."""
    main, rank = accelerator.is_main_process, accelerator.process_index
    sharded_optimizer = dist.deepspeed(accelerator)
    work = staging_dir(root, step)
    if main:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    accelerator.wait_for_everyone()
    trainable = dist.trainable_state(accelerator, unwrapped)
    optimizer_state = None if sharded_optimizer else dist.optimizer_state(accelerator, model, optimizer)
    if main:
        save_tree(work, "trainable", trainable)
        if optimizer_state is not None:
            save_tree(work, "optimizer", optimizer_state)
    if sharded_optimizer:
        save_tree(work, f"optimizer-rank{rank}", dist.zero_state_dict(optimizer))
    save_tree(work, f"rng-rank{rank}", rng_state())
    accelerator.wait_for_everyone()
    path = checkpoint_dir(root, step)
    if main:
        path = publish(root, step, {"step": step, "world_size": accelerator.num_processes,
                                    "sharded_optimizer": sharded_optimizer, **state}, keep_last)
    accelerator.wait_for_everyone()
    return path


def restore_checkpoint(accelerator, folder: pathlib.Path, *, model, unwrapped, optimizer) -> dict[str, Any]:
    """Load checkpoint ``folder`` into a prepared run (trained tensors, optimizer, this process's RNG)
    and return its ``state.json``; a damaged checkpoint is an error that names the one before it."""
    state = read_state(folder)
    try:
        with dist.full_parameters(accelerator, unwrapped, modify=True):
            unwrapped.load_trainable_state_dict(load_tree(folder, "trainable"))
        if state["sharded_optimizer"]:  # ZeRO: every process reads every partition's state
            dist.load_zero_state_dicts(model, [load_tree(folder, f"optimizer-rank{r}") for r in range(accelerator.num_processes)])
        else:
            dist.load_optimizer_state(accelerator, model, optimizer, load_tree(folder, "optimizer"))
        set_rng_state(load_tree(folder, f"rng-rank{accelerator.process_index}"))
    except SelfdraftError as err:
        others = [str(p) for p in list_checkpoints(folder.parent) if p != folder]
        hint = f"; resume from an earlier one with --resume-from {others[-1]}" if others else ""
        raise SelfdraftError(f"cannot resume from {folder}: {err}{hint}") from err
    return state
