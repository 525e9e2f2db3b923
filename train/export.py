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
    from selfdraft.train.loop import evaluation_record, export_drafter
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
    evaluation = evaluation_record(state.get("last_eval") or {}, state["step"], config.train.top_k)
    return export_drafter(objective, config, target, rank_acc, pathlib.Path(out) if out is not None else run / "drafter",
                          evaluation)



FORMATS = ("native", "vllm", "sglang", "eagle")
"""``native`` (selfdraft's own folder) or a serving engine's layout: ``vllm`` (Medusa, EAGLE-1,
EAGLE-3), ``sglang`` (EAGLE-1, EAGLE-3; also what SpecForge writes and reads) or ``eagle`` (the
reference SafeAILab/EAGLE code)."""


def export(source: str | os.PathLike, fmt: str, out: str | os.PathLike, target: str | None = None,
           acceptance: dict | None = None) -> tuple[pathlib.Path, str]:
    """Write the drafter of ``source`` (a native drafter folder or a training run) to ``out`` in
    ``fmt`` (see FORMATS), with a README.md model card in engine layouts. ``target`` overrides the
    recorded target spec (where its weights or folder are needed); ``acceptance`` is a measured
    ``{"acceptance_length", "where"}`` for the card. Returns (folder, a one-line description)."""
    from selfdraft.heads.cards import model_card
    from selfdraft.heads.io import is_drafter_folder, load_drafter, read_record
    from selfdraft.heads.target import load_target, target_folder

    if fmt not in FORMATS:
        raise SelfdraftError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    source = str(source)
    if not is_drafter_folder(source):
        folder = export_run(source, out if fmt == "native" else None)
        if fmt == "native":
            return folder, f"wrote the native drafter of run {source} to {folder}"
        source = str(folder)
    elif fmt == "native":
        raise SelfdraftError(f"{source} is already a native drafter folder")
    record = read_record(source)
    spec = target or record.target.name
    out = pathlib.Path(out).resolve()
    target_path = str(target_folder(spec) or spec)
    card = dict(engine=fmt, kind=record.kind, target=record.target.to_dict(), target_path=target_path, folder=str(out),
                run_config=record.run_config, evaluation=record.evaluation, acceptance=acceptance)
    if record.kind in ("eagle", "eagle3"):
        from selfdraft.heads.eagle_formats import ENGINE_NAMES, check_exportable, export_eagle

        drafter, record = load_drafter(source)
        check_exportable(drafter, fmt, record.target)  # before loading a target for nothing
        embed = None
        if fmt == "eagle":
            loaded = load_target(spec)
            if loaded.identity.mismatches(record.target):
                raise SelfdraftError(f"target {spec} is not the one {source} was trained for: "
                                     + "; ".join(loaded.identity.mismatches(record.target)))
            embed = loaded.model.get_input_embeddings().weight.detach()
        tree = record.decode.get("tree") or {"depth": 3, "top_k": 2, "max_nodes": 4}
        details = [f"one Llama decoder layer (hidden {drafter.hidden_size})"]
        if drafter.kind == "eagle3":
            details += [f"fuses the target's hidden_states {sorted(drafter.aux_layers)}",
                        f"draft vocabulary {drafter.draft_vocab_size} of {drafter.vocab_size} tokens"]
        text = model_card(engine_name=ENGINE_NAMES[fmt], tree=tree, details=details, **card)
        folder = export_eagle(drafter, out, fmt, record.target, embed, card=text)
        return folder, f"wrote the {record.kind} drafter for {ENGINE_NAMES[fmt]} to {folder}"
    if fmt != "vllm":
        raise SelfdraftError(f"{fmt} has no Medusa loader; export Medusa heads with --format vllm")
    from selfdraft.heads.formats import export_vllm_medusa

    lm_head = None
    if record.kind == "medusa" and not record.dims["own_lm_head"]:
        loaded = load_target(spec)
        heads, record = load_drafter(source, loaded.identity)
        lm_head = loaded.model.get_output_embeddings().weight.to(next(heads.parameters()).dtype)
    else:
        heads, record = load_drafter(source)
    K = heads.num_heads
    details = [f"{K} heads of {len(heads.blocks[0])} residual blocks",
               "its own LM heads" if heads.lm_heads is not None else "the target's LM head (copied in)"]
    text = model_card(engine_name="vLLM", tree={"depth": K, "top_k": 1, "max_nodes": K}, details=details, **card)
    folder = export_vllm_medusa(heads, out, lm_head, card=text)
    return folder, f"wrote the {record.kind} drafter in vLLM's MedusaModel layout to {folder}"
