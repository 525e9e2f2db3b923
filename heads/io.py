"""The native drafter format: a folder with ``config.json`` and ``model.safetensors`` (never pickle).

config.json records the format version, the drafter kind, its dimensions, the identity of the
target it was trained for, its decode defaults (e.g. a Medusa tree) and, optionally, the resolved
run config. Loading is strict: a missing or unknown field, a tensor name or shape that the kind does
not expect, a truncated or corrupt weights file, or a different target is an error that says which.
Folders are written atomically: into a temporary sibling, then renamed into place.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from selfdraft.errors import SelfdraftError
from selfdraft.heads.folders import CONFIG_FILE, load_strict, peek_config, read_config, read_weights, write_folder
from selfdraft.heads.kinds import Dims, get_kind
from selfdraft.heads.target import TargetIdentity

FORMAT = "selfdraft-drafter"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"


@dataclass
class DrafterRecord:
    """What config.json holds, besides the format tag and version."""

    kind: str
    """A registered drafter kind (``selfdraft.heads.kinds``): ``medusa``, ``eagle`` (EAGLE-1), ``eagle3``."""
    dims: Dims
    """The kind's dims: what its module is built from (hidden size, vocabulary, heads, layers, ...)."""
    target: TargetIdentity
    """The target the drafter was trained for; loading next to another target is refused."""
    decode: dict[str, Any] = field(default_factory=dict)
    """Decode defaults stored with the drafter (e.g. Medusa tree ``choices``)."""
    run_config: dict[str, Any] | None = None
    """The resolved training config, kept for provenance."""
    evaluation: dict[str, Any] | None = None
    """The last held-out evaluation of the run (``step`` and per-depth ``top1`` / ``topk``), for
    model cards; absent in folders written before it was recorded."""


    def to_config(self) -> dict[str, Any]:
        """config.json of a native folder holding this record."""
        config = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": self.kind, "dims": self.dims.to_dict(),
                  "target": self.target.to_dict(), "decode": self.decode, "run_config": self.run_config}
        if self.evaluation is not None:
            config["evaluation"] = self.evaluation
        return config

    @classmethod
    def from_config(cls, raw: dict[str, Any], where: str) -> "DrafterRecord":
        """Check and parse a native config.json (``where`` names it in errors)."""
        if raw.get("format_version") != FORMAT_VERSION:
            raise SelfdraftError(f"{where} has format version {raw.get('format_version')!r}; this selfdraft reads {FORMAT_VERSION}")
        expected = {"format", "format_version", "kind", "dims", "target", "decode", "run_config"}
        missing, unknown = sorted(expected - set(raw)), sorted(set(raw) - expected - {"evaluation"})
        if missing or unknown:
            raise SelfdraftError(f"{where}: missing fields {missing}, unknown fields {unknown}")
        kind = get_kind(raw["kind"])
        return cls(kind=kind.name, dims=kind.dims.from_dict(raw["dims"], f"{where}: dims"),
                   target=TargetIdentity.from_dict(raw["target"]), decode=raw["decode"] or {},
                   run_config=raw["run_config"], evaluation=raw.get("evaluation"))


def save_drafter(folder: str | os.PathLike, module: nn.Module, record: DrafterRecord) -> pathlib.Path:
    """Write ``module``'s weights and ``record`` as a drafter folder, atomically (replacing any old one)."""
    kind = get_kind(record.kind)
    if not isinstance(record.dims, kind.dims):
        raise SelfdraftError(f"a {kind.title} drafter's dims must be a {kind.dims.__name__}, got {type(record.dims).__name__}")
    return write_folder(folder, WEIGHTS_FILE, module.state_dict(), record.to_config(), metadata={"format": FORMAT})


def is_drafter_folder(path: str | os.PathLike) -> bool:
    config = peek_config(path)
    return config is not None and config.get("format") == FORMAT


def read_record(folder: str | os.PathLike) -> DrafterRecord:
    """Parse and check config.json of a drafter folder."""
    folder = pathlib.Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise SelfdraftError(f"{folder} is not a drafter folder: it has no {CONFIG_FILE}")
    raw = read_config(folder)
    if raw.get("format") != FORMAT:
        raise SelfdraftError(f"{path} is not a selfdraft drafter config (format is not {FORMAT!r})")
    return DrafterRecord.from_config(raw, str(path))


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
    module = get_kind(record.kind).build(record.dims)
    load_strict(module, state, f"{weights} does not match a {record.kind} drafter with {record.dims}")
    dtypes = {v.dtype for v in state.values()}
    if len(dtypes) == 1:
        module.to(dtype=dtypes.pop())
    return module.eval(), record
