"""Export: the one path from a training run, a checkpoint or a native folder to any format.

:func:`export` takes a native drafter folder, a run folder (its finished ``drafter/``, else its latest
complete checkpoint) or one checkpoint folder, and writes the native layout or an engine's layout
(the writers the drafter's kind declares in the registry). A checkpoint carries its drafter's record
(kind, dims, decode defaults, target identity; see :func:`drafter_record`), so exporting one builds
the drafter module from it and its trained tensors: the target is never loaded for that, and no
training objective is rebuilt. Only an engine layout that carries a copy of a target tensor (vLLM's
Medusa with a shared LM head, the reference EAGLE code's embedding) loads the target, for that tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from typing import Any

import torch

from selfdraft import __version__
from selfdraft.configs.schema import to_dict
from selfdraft.errors import SelfdraftError
from selfdraft.files import as_if_created, write_atomic
from selfdraft.heads.cards import PROFILE_FILE, SGLANG_ADAPTIVE_FILE, profile_section, sglang_schedule
from selfdraft.heads.io import DrafterRecord, is_drafter_folder, load_drafter, read_record, save_drafter
from selfdraft.heads.kinds import ExportContext, export_formats, get_kind
from selfdraft.train import checkpoint as ckpt


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


def drafter_record(objective, config, identity, rank_accuracy: torch.Tensor | None,
                   evaluation: dict[str, Any] | None) -> DrafterRecord:
    """The native record of ``objective``'s drafter as trained so far: what a checkpoint carries so
    that it exports on its own, and what the finished run's ``drafter/`` holds."""
    return DrafterRecord(kind=config.drafter.kind, dims=objective.drafter_module().dims, target=identity,
                         decode=objective.decode_defaults(rank_accuracy), run_config=to_dict(config),
                         evaluation=evaluation)


def write_native(objective, config, target, rank_accuracy: torch.Tensor | None, out: pathlib.Path,
                 evaluation: dict[str, Any] | None = None, state: dict[str, torch.Tensor] | None = None) -> pathlib.Path:
    """Write the finished run's native drafter folder, and where the run trained the target too
    (Medusa-2's LoRA) the merged target next to it (``OUT-target``), which the record then names.
    ``state``: the trained tensors in full when the objective's own are shards (FSDP)."""
    from selfdraft.heads.target import tokenizer_fingerprint

    record = drafter_record(objective, config, target.identity, rank_accuracy, evaluation)
    if objective.lora:
        merged_dir = out.parent / f"{out.name}-target"
        work = out.parent / f".{merged_dir.name}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        objective.merged_target().save_pretrained(work, safe_serialization=True)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(work)
        as_if_created(work)
        shutil.rmtree(merged_dir, ignore_errors=True)
        os.rename(work, merged_dir)
        record = dataclasses.replace(record, target=dataclasses.replace(
            record.target, name=str(merged_dir), tokenizer_hash=tokenizer_fingerprint(target.tokenizer)))
    return save_drafter(out, objective.drafter_module(state), record)


def checkpoint_drafter(folder: pathlib.Path):
    """(module, record) of a checkpoint, from the record and the trained tensors it carries."""
    state = ckpt.read_state(folder)
    if "drafter" not in state:
        raise SelfdraftError(
            f"{folder} was written by selfdraft {state.get('selfdraft_version', '0.1.0')}, before checkpoints carried "
            f"their drafter's record; this is selfdraft {__version__}. Export it with selfdraft 0.1.0, or resume the run "
            "for one step with this version (selfdraft train --resume ... train.max_steps=STEP+1) and export that checkpoint")
    record = DrafterRecord.from_config(state["drafter"], f"{folder}/state.json: drafter")
    kind = get_kind(record.kind)
    reason = kind.trains_target(_run_config(state))
    if reason:
        raise SelfdraftError(f"{folder} is a checkpoint of a run whose {reason}: its export is the drafter with the merged "
                             "target, which the finished run writes. Finish the run (selfdraft train --resume) to export it")
    module = kind.build(record.dims).float()
    prefix = state["drafter_prefix"]
    tensors = {k[len(prefix) + 1:]: v for k, v in ckpt.load_tree(folder, "trainable").items() if k.startswith(prefix + ".")}
    from selfdraft.heads.folders import load_strict

    load_strict(module, tensors, f"{folder}: the trained tensors do not form the {kind.title} drafter its record describes")
    return module.eval(), record


def _run_config(state: dict):
    from selfdraft.configs.run import RunConfig, upgrade_config_dict
    from selfdraft.configs.schema import from_dict

    return from_dict(RunConfig, upgrade_config_dict(state["config"])[0])


def export_run(run: str | os.PathLike, out: str | os.PathLike | None = None) -> pathlib.Path:
    """The native drafter folder of training run ``run`` (or of one of its checkpoint folders); with
    ``out``, written (atomically) there. A finished run has ``drafter/``; an interrupted one is exported
    from its latest complete checkpoint into ``drafter/`` unless ``out`` is given."""
    run = pathlib.Path(run)
    finished = run / "drafter"
    if (finished / "config.json").is_file():
        if out is None:
            return finished
        out = pathlib.Path(out)
        work = out.parent / f".{out.name}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(finished, work)
        as_if_created(work)  # copytree keeps the source modes, whatever they are
        shutil.rmtree(out, ignore_errors=True)
        os.rename(work, out)
        return out
    latest = run if (run / "state.json").is_file() else ckpt.latest_checkpoint(run / "checkpoints")
    if latest is None:
        raise SelfdraftError(f"{run} is neither a drafter folder nor a training run with a drafter/ or a complete checkpoint")
    module, record = checkpoint_drafter(latest)
    return save_drafter(pathlib.Path(out) if out is not None else run / "drafter", module, record)


def export(source: str | os.PathLike, fmt: str, out: str | os.PathLike, target: str | None = None,
           acceptance: dict | None = None) -> tuple[pathlib.Path, str]:
    """Write the drafter of ``source`` (a native drafter folder, a training run or a checkpoint) to
    ``out`` in ``fmt``: ``native`` or an engine layout its kind writes (``export_formats()``), with a
    README.md model card in engine layouts. ``target`` overrides the recorded target spec (where its
    weights or folder are needed); ``acceptance`` is a measured ``{"acceptance_length", "where"}`` for
    the card. Returns (folder, a one-line description)."""
    from selfdraft.heads.target import load_target, target_folder

    known = export_formats()
    if fmt not in known:
        raise SelfdraftError(f"unknown export format {fmt!r}; choose one of {', '.join(known)}")
    source = str(source)
    if not is_drafter_folder(source):
        folder = export_run(source, out if fmt == "native" else None)
        if fmt == "native":
            return folder, f"wrote the native drafter of run {source} to {folder}"
        source = str(folder)
    elif fmt == "native":
        raise SelfdraftError(f"{source} is already a native drafter folder")
    record = read_record(source)
    writer = get_kind(record.kind).writer(fmt)  # an unsupported format is refused before anything loads
    spec = target or record.target.name
    loaded = []

    def load_recorded_target():
        if not loaded:
            candidate = load_target(spec)
            diff = candidate.identity.mismatches(record.target)
            if diff:
                raise SelfdraftError(f"target {spec} is not the one {source} was trained for: " + "; ".join(diff))
            loaded.append(candidate)
        return loaded[0]

    module, record = load_drafter(source)
    context = ExportContext(record=record, out=pathlib.Path(out).resolve(), target_path=str(target_folder(spec) or spec),
                            load_target=load_recorded_target, acceptance=acceptance)
    folder, message = writer.write(module, context)
    profile = pathlib.Path(source) / PROFILE_FILE
    if profile.is_file():  # the schedule planned for this drafter on some machine travels with every export
        data = json.loads(profile.read_text())
        card = folder / "README.md"
        write_atomic(folder / PROFILE_FILE, json.dumps(data, indent=1))
        if writer.format == "sglang" and writer.per_batch_lengths:
            write_atomic(folder / SGLANG_ADAPTIVE_FILE, json.dumps(sglang_schedule(data)["speculative_adaptive_config"], indent=1))
        write_atomic(card, (card.read_text() if card.is_file() else "") +
                     profile_section(data, writer.format, str(folder), per_batch=writer.per_batch_lengths))
        message += f"; with its speculation schedule ({PROFILE_FILE})"
    return folder, message
