"""Drafter folders on disk: a JSON config beside one safetensors file (never pickle).

Writing is atomic (a temporary sibling renamed into place); reading is strict: a missing, truncated
or corrupt weights file, or tensors whose names or shapes do not fit the module, is a
:class:`SelfdraftError` that says which.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import torch
from torch import nn

from selfdraft.errors import SelfdraftError
from selfdraft.files import as_if_created

CONFIG_FILE = "config.json"

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


def read_config(folder: str | os.PathLike) -> dict:
    """A folder's config.json as a dict; a missing or malformed file is a clear error."""
    folder = pathlib.Path(folder)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise SelfdraftError(f"{folder} has no {CONFIG_FILE}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SelfdraftError(f"{folder}/{CONFIG_FILE} is not valid JSON ({err}): the folder is corrupt") from err
    if not isinstance(config, dict):
        raise SelfdraftError(f"{folder}/{CONFIG_FILE} must hold a JSON object")
    return config


def peek_config(folder: str | os.PathLike) -> dict | None:
    """A folder's config.json as a dict, or None when there is none or it is not a JSON object."""
    try:
        config = json.loads((pathlib.Path(folder) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def read_folder(folder: str | os.PathLike, weights_name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor of ``weights_name``) of a folder."""
    folder = pathlib.Path(folder)
    return read_config(folder), read_weights(folder / weights_name)
