"""Drafters from their specs: what ``--drafter`` and ``make_drafter`` accept.

A drafter that needs no training, by its registered spec (inference/drafter_specs.py: ``none``,
``prompt-lookup``, ``copy``, ``draft-model:SPEC``, ``hybrid:SPEC``), or a folder: a native drafter folder of any
registered kind (checked against the target), or a folder in a layout some kind's reader knows (an
engine export: vLLM, SGLang, the reference EAGLE code, FasterDecoding Medusa). A trained kind decodes
through its own adapter, named by its registry entry.
"""

from __future__ import annotations

import pathlib

from selfdraft.configs.decode import HybridConfig, PromptLookupConfig, TreeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.folders import peek_config
from selfdraft.heads.io import is_drafter_folder, load_drafter
from selfdraft.heads.kinds import get_kind, read_engine_folder, registered
from selfdraft.inference import drafter_specs
from selfdraft.inference.drafters import Drafter


def known_specs() -> list[str]:
    """Every spec ``make_drafter`` takes, for messages: the registered drafters, then a folder."""
    return [entry.usage for entry in drafter_specs.drafter_specs()] + [
        "PATH (a native drafter folder, or an engine export: vLLM, SGLang, reference EAGLE, FasterDecoding Medusa)"]


def tree_overrides(tree: TreeConfig | dict | None) -> dict[str, int]:
    """The tree fields a caller sets (:func:`~selfdraft.inference.drafter_specs.tree_overrides`)."""
    return drafter_specs.tree_overrides(tree)


def make_drafter(
    spec: str | Drafter,
    target,
    *,
    tree: TreeConfig | dict | None = None,
    prompt_lookup: PromptLookupConfig = PromptLookupConfig(),
    hybrid: HybridConfig = HybridConfig(),
) -> Drafter:
    """Build a drafter from its spec (see the module docstring). ``tree`` sets the tree of a trained
    drafter or a draft model: a :class:`TreeConfig`, or a dict of the fields to change in the tree
    stored with the drafter (e.g. ``{"max_nodes": 8}``; for a draft model, in :data:`DRAFT_MODEL_TREE`);
    None keeps that tree."""
    if isinstance(spec, Drafter):
        return spec
    found = drafter_specs.find_spec(spec)
    if found is not None:  # a drafter that needs no training (inference/drafter_specs.py)
        entry, argument = found
        return entry.builder()(argument, target, drafter_specs.SpecOptions(tree, prompt_lookup, hybrid))
    overrides = tree_overrides(tree)
    if is_drafter_folder(spec):
        module, record = load_drafter(spec, target.identity)
        return get_kind(record.kind).adapter_factory()(module, record.decode, target, overrides)
    folder = pathlib.Path(spec)
    config = peek_config(folder)
    found = read_engine_folder(folder, config) if config is not None else None
    if found is not None:
        kind, reader = found
        module, decode = reader.read(folder, target)
        return kind.adapter_factory()(module, decode, target, overrides)
    raise SelfdraftError(f"unknown drafter {spec!r}; choose one of: {', '.join(known_specs())} "
                         f"(trained kinds: {', '.join(sorted(registered()))})")


def folder_kind(path: str) -> str | None:
    """The registered kind of a drafter folder make_drafter reads (native or an engine layout), or None."""
    if is_drafter_folder(path):
        from selfdraft.heads.io import read_record

        return read_record(path).kind
    config = peek_config(path)
    found = read_engine_folder(pathlib.Path(path), config) if config is not None else None
    return found[0].name if found else None
