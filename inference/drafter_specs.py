"""The drafters that need no training, declared the way trained kinds are (heads/registry.py): one entry
each, built by import path, so listing them (the CLI's help, an unknown spec's error) imports neither
torch nor transformers, and :func:`~selfdraft.inference.specs.make_drafter` compares no drafter's name.

A spec is ``NAME`` or, for an entry with an ``argument``, ``NAME:ARGUMENT`` (``draft-model:SPEC``). An
entry's ``build`` names a callable ``(argument, target, options) -> Drafter`` (``options``: a
:class:`SpecOptions`). A drafter added at run time calls :func:`register_spec` with its own entry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from selfdraft.errors import SelfdraftError


@dataclass(frozen=True)
class SpecOptions:
    """What ``make_drafter`` passes every builder besides the argument and the target."""

    tree: Any = None
    """A :class:`~selfdraft.configs.decode.TreeConfig`, a dict of the tree fields to change, or None."""
    prompt_lookup: Any = None
    """The :class:`~selfdraft.configs.decode.PromptLookupConfig` (None: its defaults)."""
    hybrid: Any = None
    """The :class:`~selfdraft.configs.decode.HybridConfig` (None: its defaults)."""


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter that needs no training."""

    name: str
    help: str
    build: str
    """``"module:attr"`` of ``(argument, target, options) -> Drafter``, imported when one is made."""
    argument: str | None = None
    """The name of the argument after ``name:`` (``SPEC``), or None: the spec is the name alone."""

    @property
    def usage(self) -> str:
        return f"{self.name}:{self.argument}" if self.argument else self.name

    def argument_of(self, spec: str) -> str | None:
        """The argument ``spec`` gives this entry ("" for an entry without one), or None when it is not this entry's."""
        if self.argument is None:
            return "" if spec == self.name else None
        prefix = f"{self.name}:"
        return spec[len(prefix):] if spec.startswith(prefix) and len(spec) > len(prefix) else None

    def builder(self):
        module_name, _, path = self.build.partition(":")
        try:
            found = importlib.import_module(module_name)
            for attr in path.split("."):  # a class's method: "Class.from_spec"
                found = getattr(found, attr)
            return found
        except (ImportError, AttributeError) as err:
            raise SelfdraftError(f"the {self.usage} drafter ({self.build}) cannot be imported: {err}") from err


_SPECS: dict[str, DrafterSpec] = {}


def register_spec(entry: DrafterSpec, *, replace: bool = False) -> DrafterSpec:
    """Add ``entry`` (a second entry of the same name is refused unless ``replace``)."""
    if entry.name in _SPECS and not replace and _SPECS[entry.name] is not entry:
        raise SelfdraftError(f"a drafter named {entry.name!r} is already registered")
    _SPECS[entry.name] = entry
    return entry


def drafter_specs() -> list[DrafterSpec]:
    """Every registered entry, in registration order."""
    return list(_SPECS.values())


def tree_overrides(tree) -> dict[str, int]:
    """The tree fields a caller sets: all of a TreeConfig, those given in a dict (checked), none for None."""
    import dataclasses

    from selfdraft.configs.decode import TreeConfig

    if tree is None:
        return {}
    if isinstance(tree, TreeConfig):
        return dataclasses.asdict(tree)
    fields = {f.name for f in dataclasses.fields(TreeConfig)}
    unknown = sorted(set(tree) - fields)
    if unknown:
        raise SelfdraftError(f"unknown tree option {', '.join(unknown)}; a tree has {', '.join(sorted(fields))}")
    values = {k: v for k, v in tree.items() if v is not None}
    TreeConfig(**values)  # each value checked now
    return values


def find_spec(spec: str) -> tuple[DrafterSpec, str] | None:
    """(the entry, its argument) that ``spec`` names, or None."""
    for entry in _SPECS.values():
        argument = entry.argument_of(spec)
        if argument is not None:
            return entry, argument
    return None


for _entry in (
    DrafterSpec("none", "no drafter: one token per target forward, through the same loop",
                "selfdraft.inference.drafters:NoDrafter.from_spec"),
    DrafterSpec("prompt-lookup", "copies what followed earlier occurrences of the last n tokens",
                "selfdraft.inference.drafters:PromptLookupDrafter.from_spec"),
    DrafterSpec("copy", "suffix-match copying: the frequent continuations of the longest earlier match, valued",
                "selfdraft.inference.hybrid:CopyDrafter.from_spec"),
    DrafterSpec("draft-model", "a separate small causal LM with the target's tokenizer",
                "selfdraft.inference.drafters:DraftModelDrafter.from_spec", argument="SPEC"),
    DrafterSpec("hybrid", "copying and the drafter SPEC merged into one tree per step",
                "selfdraft.inference.hybrid:HybridDrafter.from_spec", argument="SPEC"),
):
    register_spec(_entry)
