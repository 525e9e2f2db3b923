"""Medusa layouts of other projects: vLLM's ``MedusaModel`` (export and import) and the original
FasterDecoding layout (import). Key names and config fields follow those projects' loaders.

vLLM ``MedusaModel``: config.json with ``architectures: ["MedusaModel"]``, ``model_type: "medusa"``,
``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (blocks per head),
``medusa_fc_bias`` and ``original_lm_head``; tensors ``blocks.{h}.layers.{l}.weight`` / ``.bias`` and
``lm_heads.{h}.weight`` (or one ``lm_head.weight`` when ``original_lm_head`` is true).

FasterDecoding Medusa: config.json with ``medusa_num_heads`` and ``medusa_num_layers``; tensors
``{h}.{l}.linear.weight`` / ``.bias`` for the blocks and ``{h}.{L}.weight`` for each head's own LM
head, in ``medusa_lm_head.safetensors`` (the pickled ``.pt`` variant is refused).
"""

from __future__ import annotations

import os
import pathlib
import re

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.cards import model_card, vllm_command
from selfdraft.heads.folders import load_strict, read_folder, write_folder
from selfdraft.heads.kinds.medusa.module import MedusaHeads
from selfdraft.heads.registry import EngineReader, EngineWriter, ExportContext

VLLM_WEIGHTS = "model.safetensors"
FASTERDECODING_WEIGHTS = "medusa_lm_head.safetensors"


def _block_key(name: str) -> tuple[int, int, str] | None:
    """Our ``blocks.{h}.{l}.linear.{weight|bias}`` -> (h, l, weight|bias)."""
    m = re.fullmatch(r"blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)", name)
    return (int(m[1]), int(m[2]), m[3]) if m else None


def export_vllm_medusa(heads: MedusaHeads, folder: str | os.PathLike, lm_head_weight: torch.Tensor | None = None,
                       card: str | None = None) -> pathlib.Path:
    """Write ``heads`` in vLLM's MedusaModel layout (vLLM 0.32.0 ``model_executor/models/medusa.py``),
    with ``card`` as README.md. Heads that share the target's LM head need its weight (V, D): vLLM's
    Medusa holds its own copy (``original_lm_head``)."""

    shared = heads.lm_heads is None
    if shared and lm_head_weight is None:
        raise SelfdraftError("these Medusa heads share the target's LM head: pass the target so its weight can be exported")
    tensors = {}
    for name, value in heads.state_dict().items():
        block = _block_key(name)
        if block:
            h, l, kind = block
            tensors[f"blocks.{h}.layers.{l}.{kind}"] = value
        else:  # lm_heads.{h}.weight keeps its name
            tensors[name] = value
    if shared:
        tensors["lm_head.weight"] = lm_head_weight
    config = {
        "architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size, "num_heads": heads.num_heads, "num_hidden_layers": len(heads.blocks[0]),
        "medusa_fc_bias": True, "original_lm_head": shared, "truncated_vocab_size": heads.vocab_size,
    }
    return write_folder(folder, VLLM_WEIGHTS, tensors, config, extra_files={"README.md": card} if card else None)


def import_vllm_medusa(folder: str | os.PathLike) -> tuple[MedusaHeads, torch.Tensor | None]:
    """Read vLLM's MedusaModel layout: (heads, the shared LM head weight or None).

    With ``original_lm_head`` the heads are built to share an LM head and its weight is returned
    (decoding uses the target's own LM head; compare them when it matters)."""
    config, tensors = read_folder(folder, VLLM_WEIGHTS)
    _require(config, folder, "hidden_size", "vocab_size", "num_heads", "num_hidden_layers")
    if config.get("truncated_vocab_size", config["vocab_size"]) != config["vocab_size"] or "token_map" in tensors:
        raise SelfdraftError(f"{folder}: truncated-vocabulary Medusa (token_map) is not supported yet")
    shared = bool(config.get("original_lm_head", False))
    heads = MedusaHeads(config["hidden_size"], config["vocab_size"], config["num_heads"], config["num_hidden_layers"], own_lm_head=not shared)
    tensors = {name.replace("medusa_heads.", "", 1): value for name, value in tensors.items()}
    state = {}
    for name, value in tensors.items():
        m = re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", name)
        if m:
            state[f"blocks.{m[1]}.{m[2]}.linear.{m[3]}"] = value
        elif not shared and re.fullmatch(r"lm_heads\.\d+\.weight", name):
            state[name] = value
    if not config.get("medusa_fc_bias", False):  # vLLM's default: blocks without bias
        state.update({k: torch.zeros_like(v) for k, v in heads.state_dict().items() if k.endswith(".bias")})
    shared_weight = tensors.get("lm_head.weight", tensors.get("lm_heads.0.weight")) if shared else None
    if shared and shared_weight is None:
        raise SelfdraftError(f"{folder}: original_lm_head is set but there is no lm_head.weight")
    load_strict(heads, state, f"{folder}: tensors do not form the Medusa heads its config describes")
    return heads, shared_weight


def import_fasterdecoding_medusa(folder: str | os.PathLike) -> MedusaHeads:
    """Read the original FasterDecoding Medusa layout (safetensors only)."""
    folder = pathlib.Path(folder)
    if not (folder / FASTERDECODING_WEIGHTS).is_file() and (folder / "medusa_lm_head.pt").is_file():
        raise SelfdraftError(f"{folder} holds only medusa_lm_head.pt (pickle); selfdraft never unpickles weights. "
                             "Convert it to medusa_lm_head.safetensors in a trusted environment first")
    config, tensors = read_folder(folder, FASTERDECODING_WEIGHTS)
    _require(config, folder, "medusa_num_heads", "medusa_num_layers")
    num_heads, num_layers = config["medusa_num_heads"], config["medusa_num_layers"]
    first_proj = tensors.get(f"0.{num_layers}.weight")
    if first_proj is None:
        raise SelfdraftError(f"{folder}: no 0.{num_layers}.weight (the first head's LM head)")
    vocab, hidden = first_proj.shape
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers, own_lm_head=True)
    state = {}
    for name, value in tensors.items():
        m = re.fullmatch(r"(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)", name)
        if not m:
            continue
        h, l = int(m[1]), int(m[2])
        state[f"lm_heads.{h}.weight" if l == num_layers else f"blocks.{h}.{l}.linear.{m[3]}"] = value
    load_strict(heads, state, f"{folder}: tensors do not form the Medusa heads its config describes")
    return heads


def _require(config: dict, folder, *keys: str) -> None:
    missing = [k for k in keys if k not in config]
    if missing:
        raise SelfdraftError(f"{folder}/config.json lacks {missing}")


# ----------------------------------------------------------------------------------------------
# The registry's view: one writer (vLLM) and two readers


def _write_vllm(heads: MedusaHeads, ctx: ExportContext) -> tuple[pathlib.Path, str]:
    record = ctx.record
    lm_head = None
    if heads.lm_heads is None:  # vLLM's Medusa holds its own copy of the shared LM head
        loaded = ctx.load_target()
        lm_head = loaded.model.get_output_embeddings().weight.detach().to(next(heads.parameters()).dtype)
    K = heads.num_heads
    details = [f"{K} heads of {len(heads.blocks[0])} residual blocks",
               "its own LM heads" if heads.lm_heads is not None else "the target's LM head (copied in)"]
    card = model_card(engine="vllm", engine_name="vLLM", title="Medusa", target=record.target.to_dict(),
                      folder=str(ctx.out), run_config=record.run_config, evaluation=record.evaluation,
                      details=details, acceptance=ctx.acceptance,
                      command=vllm_command(ctx.target_path, str(ctx.out), "medusa", K))
    folder = export_vllm_medusa(heads, ctx.out, lm_head, card=card)
    return folder, f"wrote the medusa drafter in vLLM's MedusaModel layout to {folder}"


def _is_vllm(folder: pathlib.Path, config: dict) -> bool:
    return (config.get("architectures") or [None])[0] == "MedusaModel" and (folder / VLLM_WEIGHTS).is_file()


def _read_vllm(folder: pathlib.Path, target) -> tuple[MedusaHeads, dict]:
    heads, shared = import_vllm_medusa(folder)
    if shared is not None:
        theirs = target.model.get_output_embeddings().weight
        if tuple(shared.shape) != tuple(theirs.shape) or not torch.equal(shared.to(theirs.dtype).cpu(), theirs.detach().cpu()):
            raise SelfdraftError(f"{folder} carries a copy of an LM head that is not this target's: it was exported for "
                                 "another target")
    return heads, {}


def _is_fasterdecoding(folder: pathlib.Path, config: dict) -> bool:
    return "medusa_num_heads" in config


def _read_fasterdecoding(folder: pathlib.Path, target) -> tuple[MedusaHeads, dict]:
    return import_fasterdecoding_medusa(folder), {}


def _vllm_serving(config: dict) -> dict | None:
    """vLLM's Medusa drafts one token per head, so num_speculative_tokens is the head count."""
    if (config.get("architectures") or [None])[0] != "MedusaModel":
        return None
    return {"method": "medusa", "num_speculative_tokens": int(config["num_heads"]), "fixed": True}


WRITERS = (EngineWriter("vllm", "vLLM", _write_vllm, served_as=_vllm_serving),)
READERS = (EngineReader("vLLM MedusaModel", _is_vllm, _read_vllm),
           EngineReader("FasterDecoding Medusa", _is_fasterdecoding, _read_fasterdecoding))
