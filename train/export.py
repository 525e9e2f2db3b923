"""Export a training run: its finished ``drafter/`` folder, or a drafter built from its latest checkpoint."""

from __future__ import annotations

import os
import pathlib
import shutil

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.files import as_if_created


def export_run(run: str | os.PathLike, out: str | os.PathLike | None = None) -> pathlib.Path:
    """The native drafter folder of training run ``run``; with ``out``, written (atomically) there.

    A finished run has ``drafter/``; an interrupted one is exported from its latest complete
    checkpoint, with the sparse tree of the last evaluation that checkpoint recorded.
    """
    from selfdraft.configs.run import RunConfig
    from selfdraft.configs.schema import from_dict
    from selfdraft.heads.target import load_target
    from selfdraft.train import checkpoint as ckpt
    from selfdraft.train.loop import export_drafter
    from selfdraft.train.objectives import build_objective

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
    latest = ckpt.latest_checkpoint(run / "checkpoints")
    if latest is None:
        raise SelfdraftError(f"{run} is neither a drafter folder nor a training run with a drafter/ or a complete checkpoint")
    state = ckpt.read_state(latest)
    config = from_dict(RunConfig, state["config"]).validate()
    target = load_target(config.target.spec, dtype=config.target.dtype, trust_remote_code=config.target.trust_remote_code)
    objective = build_objective(config, target.model)  # an EAGLE-3 vocabulary map comes with the checkpoint
    objective.load_trainable_state_dict(ckpt.load_tree(latest, "trainable"))
    rank_acc = torch.tensor(state["rank_accuracy"]) if state.get("rank_accuracy") else None
    return export_drafter(objective, config, target, rank_acc, pathlib.Path(out) if out is not None else run / "drafter")



def export(source: str | os.PathLike, fmt: str, out: str | os.PathLike, target: str | None = None) -> tuple[pathlib.Path, str]:
    """Write the drafter of ``source`` (a native drafter folder or a training run) to ``out`` in
    ``fmt``: ``native``, ``vllm`` or ``sglang``. Returns (folder, a one-line description)."""
    from selfdraft.heads.formats import export_vllm_medusa
    from selfdraft.heads.io import is_drafter_folder, load_drafter, read_record
    from selfdraft.heads.target import load_target

    source = str(source)
    if not is_drafter_folder(source):
        folder = export_run(source, out if fmt == "native" else None)
        if fmt == "native":
            return folder, f"wrote the native drafter of run {source} to {folder}"
        source = str(folder)
    elif fmt == "native":
        raise SelfdraftError(f"{source} is already a native drafter folder")
    record = read_record(source)
    if record.kind in ("eagle", "eagle3"):
        from selfdraft.heads.eagle_formats import ARCHITECTURES, export_eagle

        drafter, record = load_drafter(source)
        folder = export_eagle(drafter, out)
        return folder, f"wrote {record.kind} drafter in the {ARCHITECTURES[record.kind]} layout ({fmt}) to {folder}"
    if fmt == "sglang":
        raise SelfdraftError("SGLang has no Medusa loader; export Medusa heads with --format vllm")
    lm_head = None
    if record.kind == "medusa" and not record.dims["own_lm_head"]:
        loaded = load_target(target or record.target.name)
        heads, record = load_drafter(source, loaded.identity)
        lm_head = loaded.model.get_output_embeddings().weight.to(next(heads.parameters()).dtype)
    else:
        heads, record = load_drafter(source)
    folder = export_vllm_medusa(heads, out, lm_head)
    return folder, f"wrote {record.kind} drafter in vLLM's MedusaModel layout to {folder}"
