"""Drafters from their specs: what ``--drafter`` and ``make_drafter`` accept.

``none``, ``prompt-lookup``, ``copy``, ``draft-model:SPEC``, ``hybrid:SPEC`` (copy drafting merged with
the drafter SPEC, inference/hybrid.py), or a folder: a native drafter folder of any
registered kind (checked against the target), or a folder in a layout some kind's reader knows (an
engine export: vLLM, SGLang, the reference EAGLE code, FasterDecoding Medusa). A trained kind decodes
through its own adapter, named by its registry entry.
"""

from __future__ import annotations

import dataclasses
import pathlib

from selfdraft.configs.decode import DRAFT_MODEL_TREE, HybridConfig, PromptLookupConfig, TreeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.folders import peek_config
from selfdraft.heads.io import is_drafter_folder, load_drafter
from selfdraft.heads.kinds import get_kind, read_engine_folder, registered
from selfdraft.inference.drafters import DraftModelDrafter, Drafter, NoDrafter, PromptLookupDrafter
from selfdraft.inference.hybrid import CopyDrafter, hybrid_for

DRAFTER_SPECS = ("none", "prompt-lookup", "copy", "draft-model:SPEC", "hybrid:SPEC (copying merged with the drafter SPEC)",
                 "PATH (a native drafter folder, or an engine export: vLLM, SGLang, reference EAGLE, FasterDecoding Medusa)")


def tree_overrides(tree: TreeConfig | dict | None) -> dict[str, int]:
    """The tree fields a caller sets: all of a TreeConfig, those given in a dict (checked), none for None."""
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
    if spec == "none":
        return NoDrafter()
    if spec == "prompt-lookup":
        return PromptLookupDrafter(prompt_lookup)
    if spec == "copy":
        return CopyDrafter()
    if spec.startswith("hybrid:"):
        inner = spec[len("hybrid:"):]
        if not inner or inner.startswith("hybrid:") or inner in ("copy", "none"):
            raise SelfdraftError(f"hybrid:SPEC needs a drafter to merge with copying (a drafter folder or "
                                 f"draft-model:SPEC), got {inner!r}")
        return hybrid_for(target, make_drafter(inner, target, tree=tree, prompt_lookup=prompt_lookup), hybrid)
    overrides = tree_overrides(tree)
    if spec.startswith("draft-model:") and spec[len("draft-model:"):]:
        from selfdraft.heads.target import load_target

        draft = load_target(spec[len("draft-model:"):], dtype=target.dtype, device=str(target.device))
        return DraftModelDrafter.for_target(draft, target, dataclasses.replace(DRAFT_MODEL_TREE, **overrides))
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
    raise SelfdraftError(f"unknown drafter {spec!r}; choose one of: {', '.join(DRAFTER_SPECS)} "
                         f"(trained kinds: {', '.join(sorted(registered()))})")


def folder_kind(path: str) -> str | None:
    """The registered kind of a drafter folder make_drafter reads (native or an engine layout), or None."""
    if is_drafter_folder(path):
        from selfdraft.heads.io import read_record

        return read_record(path).kind
    config = peek_config(path)
    found = read_engine_folder(pathlib.Path(path), config) if config is not None else None
    return found[0].name if found else None
