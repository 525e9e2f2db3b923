"""The native drafter format: a folder with ``config.json`` and ``model.safetensors`` (never pickle).

config.json records the format version, the drafter kind, its dimensions, the identity of the
target it was trained for, its decode defaults (e.g. a Medusa tree) and, optionally, the resolved
run config. Loading is strict: a missing or unknown field, a tensor name or shape that the kind does
not expect, a truncated or corrupt weights file, or a different target is an error that says which.
Folders are written atomically: into a temporary sibling, then renamed into place.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from selfdraft.errors import SelfdraftError
from selfdraft.files import as_if_created
from selfdraft.heads.medusa import MedusaHeads
from selfdraft.heads.target import TargetIdentity

FORMAT = "selfdraft-drafter"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class DrafterRecord:
    """What config.json holds, besides the format tag and version."""

    kind: str
    """Drafter kind: ``medusa``, ``eagle`` (EAGLE-1) or ``eagle3``."""
    dims: dict[str, Any]
    """Constructor arguments of the head module (hidden size, vocab, heads, layers, ...)."""
    target: TargetIdentity
    """The target the drafter was trained for; loading next to another target is refused."""
    decode: dict[str, Any] = field(default_factory=dict)
    """Decode defaults stored with the drafter (e.g. Medusa tree ``choices``)."""
    run_config: dict[str, Any] | None = None
    """The resolved training config, kept for provenance."""
    evaluation: dict[str, Any] | None = None
    """The last held-out evaluation of the run (``step`` and per-depth ``top1`` / ``topk``), for
    model cards; absent in folders written before it was recorded."""


def _build_medusa(dims: dict[str, Any]) -> nn.Module:
    return MedusaHeads(
        hidden_size=dims["hidden_size"], vocab_size=dims["vocab_size"], num_heads=dims["num_heads"],
        num_layers=dims["num_layers"], own_lm_head=dims["own_lm_head"],
    )


def _build_eagle(dims: dict[str, Any]) -> nn.Module:
    from selfdraft.heads.eagle import EagleDrafter

    return EagleDrafter(dims)


BUILDERS = {
    "medusa": (_build_medusa, ("hidden_size", "vocab_size", "num_heads", "num_layers", "own_lm_head")),
    "eagle": (_build_eagle, ("kind", "vocab_size", "layer_config")),
    "eagle3": (_build_eagle, ("kind", "vocab_size", "layer_config", "aux_layers", "draft_vocab_size")),
}
OPTIONAL_DIMS = {"eagle": ("fc_bias",)}
"""Dims a kind may carry beyond its required ones (an EAGLE-1 drafter imported with an fc bias)."""


def medusa_dims(heads: MedusaHeads) -> dict[str, Any]:
    return {
        "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size, "num_heads": heads.num_heads,
        "num_layers": len(heads.blocks[0]), "own_lm_head": heads.lm_heads is not None,
    }


def write_folder(folder: str | os.PathLike, weights_name: str, tensors: dict[str, torch.Tensor], config: dict,
                 metadata: dict[str, str] | None = None, extra_files: dict[str, str] | None = None) -> pathlib.Path:
    """Write ``config.json``, a safetensors file and ``extra_files`` (name -> text, e.g. a README.md
    model card) as one folder, atomically: all go into a temporary sibling that is renamed into
    place (an old folder is replaced only once the new is whole)."""
    from safetensors.torch import save_file

    folder = pathlib.Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(work / weights_name), metadata=metadata)
        (work / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name, text in (extra_files or {}).items():
            (work / name).write_text(text, encoding="utf-8")
        as_if_created(work)
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{os.getpid()}"
            os.rename(folder, old)
            os.rename(work, folder)
            shutil.rmtree(old)
        else:
            os.rename(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def save_drafter(folder: str | os.PathLike, module: nn.Module, record: DrafterRecord) -> pathlib.Path:
    """Write ``module``'s weights and ``record`` as a drafter folder, atomically (replacing any old one)."""
    if record.kind not in BUILDERS:
        raise SelfdraftError(f"unknown drafter kind {record.kind!r}; known: {', '.join(BUILDERS)}")
    config = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": record.kind, "dims": record.dims,
        "target": record.target.to_dict(), "decode": record.decode, "run_config": record.run_config,
    }
    if record.evaluation is not None:
        config["evaluation"] = record.evaluation
    return write_folder(folder, WEIGHTS_FILE, module.state_dict(), config, metadata={"format": FORMAT})


def is_drafter_folder(path: str | os.PathLike) -> bool:
    config = pathlib.Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("format") == FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def read_record(folder: str | os.PathLike) -> DrafterRecord:
    """Parse and check config.json of a drafter folder."""
    folder = pathlib.Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise SelfdraftError(f"{folder} is not a drafter folder: it has no {CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SelfdraftError(f"{path} is not valid JSON ({err}): the export is corrupt") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise SelfdraftError(f"{path} is not a selfdraft drafter config (format is not {FORMAT!r})")
    if raw.get("format_version") != FORMAT_VERSION:
        raise SelfdraftError(f"{path} has format version {raw.get('format_version')!r}; this selfdraft reads {FORMAT_VERSION}")
    expected = {"format", "format_version", "kind", "dims", "target", "decode", "run_config"}
    missing, unknown = sorted(expected - set(raw)), sorted(set(raw) - expected - {"evaluation"})
    if missing or unknown:
        raise SelfdraftError(f"{path}: missing fields {missing}, unknown fields {unknown}")
    if raw["kind"] not in BUILDERS:
        raise SelfdraftError(f"{path}: unknown drafter kind {raw['kind']!r}; known: {', '.join(BUILDERS)}")
    _, dim_names = BUILDERS[raw["kind"]]
    dims = raw["dims"]
    optional = OPTIONAL_DIMS.get(raw["kind"], ())
    if not isinstance(dims, dict) or not set(dim_names) <= set(dims) <= set(dim_names) | set(optional):
        raise SelfdraftError(f"{path}: dims must have exactly {sorted(dim_names)} (optionally {sorted(optional)}), "
                             f"got {sorted(dims) if isinstance(dims, dict) else dims!r}")
    return DrafterRecord(
        kind=raw["kind"], dims=dims, target=TargetIdentity.from_dict(raw["target"]),
        decode=raw["decode"] or {}, run_config=raw["run_config"], evaluation=raw.get("evaluation"),
    )


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; a missing, truncated or corrupt file is a clear error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    if not path.is_file():
        raise SelfdraftError(f"{path.parent} has no {path.name}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise SelfdraftError(f"{path} is truncated or corrupt ({err}); write it again") from err


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], mismatch: str) -> None:
    """Load ``state`` into ``module`` only if names and shapes match exactly; otherwise raise
    ``mismatch`` followed by the missing, unexpected and wrongly shaped tensors."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))
        unexpected = sorted(set(got) - set(expected))
        shapes = [f"{k}: {got[k]} instead of {expected[k]}" for k in sorted(set(expected) & set(got)) if got[k] != expected[k]]
        raise SelfdraftError(f"{mismatch}: missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shapes {shapes[:5]}")
    module.load_state_dict(state, strict=True)


def load_drafter(folder: str | os.PathLike, target: TargetIdentity | None = None) -> tuple[nn.Module, DrafterRecord]:
    """Load a drafter folder: (head module on CPU in its saved dtype, record).

    With ``target``, refuse a drafter trained for a different target (vocab, hidden size, layers or
    tokenizer), naming each differing field.
    """
    folder = pathlib.Path(folder)
    record = read_record(folder)
    if target is not None:
        diff = target.mismatches(record.target)
        if diff:
            raise SelfdraftError(
                f"drafter {folder} was trained for target {record.target.name!r}, not {target.name!r}: " + "; ".join(diff)
            )
    weights = folder / WEIGHTS_FILE
    state = read_weights(weights)
    build, _ = BUILDERS[record.kind]
    module = build(record.dims)
    load_strict(module, state, f"{weights} does not match a {record.kind} drafter with {record.dims}")
    dtypes = {v.dtype for v in state.values()}
    if len(dtypes) == 1:
        module.to(dtype=dtypes.pop())
    return module.eval(), record
