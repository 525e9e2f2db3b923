"""The registry of trained drafter kinds: the one place that knows which kinds exist.

A kind (Medusa, EAGLE-1, EAGLE-3, ...) is declared once, as a :class:`DrafterKind`, by the folder
that implements it (``heads/kinds/<name>/``; see ``docs/architecture.md``). Everything else (the
native folder format, the training loop, export, decoding, the bench, the CLI) asks the registry and
never compares a kind's name itself.

A kind's parts sit on both sides of the one-way dependencies ``configs <- heads <- {train,
inference}``: its dims, module, feature layers and engine layouts are heads-level objects held here
directly; its training objective and its decode adapter are named by import path (``"module:attr"``)
and imported only when the training loop or the decoder asks for them, so that decoding never
imports a training module and this module imports neither side.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from selfdraft.configs.run import register_kind, unregister_kind
from selfdraft.errors import SelfdraftError

if TYPE_CHECKING:  # annotations only
    from torch import nn


@dataclass(frozen=True)
class Dims:
    """Base of every kind's dims: the constructor arguments of its module, saved in ``config.json``.

    Subclasses are frozen dataclasses; ``to_dict`` is what a native folder stores and ``from_dict``
    reads it back strictly (an unknown or missing field is a :class:`SelfdraftError`)."""

    KIND_FIELD: ClassVar[str | None] = None
    """A kind name written first in the stored dict (EAGLE folders have always carried one)."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {"kind": self.KIND_FIELD, **out} if self.KIND_FIELD else out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "dims"):
        if not isinstance(data, dict):
            raise SelfdraftError(f"{where} must be a mapping, got {data!r}")
        data = dict(data)
        if cls.KIND_FIELD is not None:
            stored = data.pop("kind", cls.KIND_FIELD)
            if stored != cls.KIND_FIELD:
                raise SelfdraftError(f"{where} name kind {stored!r}, expected {cls.KIND_FIELD!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = {n for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing, unknown = sorted(required - set(data)), sorted(set(data) - set(fields))
        if missing or unknown:
            raise SelfdraftError(f"{where}: missing {missing}, unknown {unknown}; a {cls.__name__} has "
                                 f"{sorted(fields)}")
        return cls(**data)


@dataclass(frozen=True)
class ExportContext:
    """What an engine writer gets besides the module: the native record, where to write, the target
    spec to name in the serving command, and a loader for the target's weights (called only by the
    layouts that carry a copy of one of its tensors)."""

    record: Any
    """The drafter's :class:`~selfdraft.heads.io.DrafterRecord`."""
    out: pathlib.Path
    target_path: str
    """The target as the serving command names it (a folder, or the spec)."""
    load_target: Callable[[], Any]
    """() -> a loaded :class:`~selfdraft.heads.target.Target` of the recorded target."""
    acceptance: dict[str, Any] | None = None
    """A measured ``{"acceptance_length", "where"}`` for the model card, or None."""


@dataclass(frozen=True)
class EngineWriter:
    """One engine's layout of a kind: ``write(module, context) -> (folder, message)``."""

    format: str
    """The ``selfdraft export --format`` name (``vllm``, ``sglang``, ``eagle-reference``, ...)."""
    engine: str
    """The engine's name for messages and cards."""
    write: Callable[[Any, ExportContext], tuple[pathlib.Path, str]]
    served_as: Callable[[dict], dict[str, Any] | None] | None = None
    """(an exported folder's config.json) -> how the engine serves it, for folders this writer wrote:
    ``{"method": ..., "num_speculative_tokens": default, "fixed": whether that number is the only
    one it takes}`` (vLLM's ``speculative_config``); None for another layout."""
    per_batch_lengths: bool = True
    """Whether the engine takes the speculation schedule's draft length per batch size for this layout
    (vLLM's ``num_speculative_tokens_per_batch_size``, SGLang's adaptive config); False: it verifies a
    fixed length, and the card gives the batch size above which drafting does not pay."""


@dataclass(frozen=True)
class EngineReader:
    """A layout of a kind that selfdraft reads (its own exports and published drafters)."""

    name: str
    detect: Callable[[pathlib.Path, dict], bool]
    """(folder, its parsed config.json) -> whether the folder is in this layout; cheap, never raises."""
    read: Callable[[pathlib.Path, Any], tuple[Any, dict[str, Any]]]
    """(folder, the loaded Target) -> (module, decode defaults); errors are SelfdraftError."""


@dataclass(frozen=True)
class DrafterKind:
    """Everything the rest of selfdraft needs to know about one trained drafter kind."""

    name: str
    """What ``drafter.kind`` says in run configs and ``kind`` in native folders."""
    title: str
    """The kind's name for people (model cards, messages)."""
    dims: type[Dims]
    build: Callable[[Any], "nn.Module"]
    """dims -> a fresh module (weights on the CPU, random or zero-initialised)."""
    feature_layers: Callable[[Any, int], list[int]]
    """(the run config, the target's layer count) -> the ``hidden_states`` indices the drafter trains
    on; the last is always the final normed state (index = layer count)."""
    objective: str
    """``"module:attr"`` of the training objective class (training side, imported on demand)."""
    adapter: str
    """``"module:attr"`` of ``(module, record, target, tree) -> Drafter`` (inference side, on demand)."""
    section: tuple[str, type] | None = None
    """``(name, dataclass)``: the run config's ``drafter.<name>`` section that holds the kind's options
    (kinds of one family share one). The dataclass's ``problems(run_config) -> list[str]`` checks them;
    its ``UPGRADED_KEYS`` (optional) names keys an older version wrote that now live in ``drafter.tree``."""
    default: bool = False
    """Whether a run config that names no ``drafter.kind`` trains this kind (one registered kind at most)."""
    writers: tuple[EngineWriter, ...] = ()
    readers: tuple[EngineReader, ...] = ()
    tree_options: tuple[str, ...] = ("depth", "top_k", "max_nodes")
    """The :class:`~selfdraft.configs.decode.TreeConfig` fields its decoding takes (Medusa: the node budget only)."""
    trains_target: Callable[[Any], str | None] = field(default=lambda config: None)
    """(the run config) -> why the run changes the target too (e.g. "Medusa-2 trains the target (LoRA
    adapters on it)"), or None: its features then cannot be cached, and its export carries a merged
    target."""

    def objective_class(self) -> type:
        return _resolve(self.objective, f"the {self.title} training objective")

    def adapter_factory(self) -> Callable:
        return _resolve(self.adapter, f"the {self.title} decode adapter")

    def writer(self, fmt: str) -> EngineWriter:
        for writer in self.writers:
            if writer.format == fmt:
                return writer
        have = ", ".join(["native", *(w.format for w in self.writers)])
        raise SelfdraftError(f"{self.title} drafters export as {have}, not {fmt!r}")


_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind, *, replace: bool = False) -> DrafterKind:
    """Add ``kind`` to the registry (a second kind of the same name is refused unless ``replace``)."""
    if kind.name in _KINDS and not replace and _KINDS[kind.name] is not kind:
        raise SelfdraftError(f"a drafter kind named {kind.name!r} is already registered")
    formats = [w.format for w in kind.writers]
    if len(set(formats)) != len(formats) or "native" in formats:
        raise SelfdraftError(f"drafter kind {kind.name!r}: export formats must be distinct and not 'native', got {formats}")
    register_kind(kind.name, kind.section, kind.default)
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    if _KINDS.pop(name, None) is not None:
        unregister_kind(name)


def registered() -> dict[str, DrafterKind]:
    """Every registered kind by name (the built-in ones come with ``selfdraft.heads.kinds``)."""
    return dict(_KINDS)


def get_kind(name: str) -> DrafterKind:
    """The kind called ``name``; an unknown name is an error naming the ones that exist."""
    try:
        return _KINDS[name]
    except KeyError:
        raise SelfdraftError(f"unknown drafter kind {name!r}; known kinds: {', '.join(sorted(_KINDS)) or 'none'}") from None


def export_formats() -> list[str]:
    """``native`` and every engine format some registered kind writes."""
    names = ["native"]
    for kind in _KINDS.values():
        names += [w.format for w in kind.writers if w.format not in names]
    return names


def served_as(engine: str, config: dict) -> dict[str, Any] | None:
    """How ``engine`` serves an exported folder with this config.json (see ``EngineWriter.served_as``),
    from the writer that wrote it; None when no registered writer for that engine did."""
    for kind in _KINDS.values():
        for writer in kind.writers:
            if writer.format == engine and writer.served_as is not None:
                found = writer.served_as(config)
                if found is not None:
                    return found
    return None


def kind_of_module(module) -> DrafterKind:
    """The registered kind whose dims type a module's ``dims`` is."""
    for kind in _KINDS.values():
        if isinstance(getattr(module, "dims", None), kind.dims):
            return kind
    raise SelfdraftError(f"{type(module).__name__} is not the module of a registered drafter kind")


def read_engine_folder(folder: pathlib.Path, config: dict) -> tuple[DrafterKind, EngineReader] | None:
    """The (kind, reader) whose layout ``folder`` is in, or None."""
    for kind in _KINDS.values():
        for reader in kind.readers:
            if reader.detect(folder, config):
                return kind, reader
    return None


def _resolve(path: str, what: str):
    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise SelfdraftError(f"{what} ({path}) cannot be imported: {err}") from err
