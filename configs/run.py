"""The training run config: one YAML file with ``target``, ``data``, ``drafter`` and ``train`` sections.

Load it with :func:`load_run_config` (a preset name from this folder or a path, plus ``a.b=value``
overrides). Every key is checked: an unknown key or a value of the wrong type is an error naming the
dotted key. The resolved config (``to_dict``) is saved next to every checkpoint and export.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pathlib
from dataclasses import dataclass, field
from typing import Literal

from selfdraft.configs.decode import TreeConfig
from selfdraft.configs.schema import DataConfig, apply_overrides, check_keys, from_dict, load_yaml, to_dict
from selfdraft.errors import SelfdraftError

PRESET_DIR = pathlib.Path(__file__).resolve().parent
"""Where the shipped YAML presets live (``configs/`` in the repository)."""


@dataclass(frozen=True)
class TargetConfig:
    """The frozen target the drafter is trained for."""

    spec: str = "smollm2-135m"
    """Built-in name, local HF model folder or hub name (see ``selfdraft.heads.target``)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype the target's weights are held in during training (the heads' weights stay fp32): auto is
    bfloat16 on a GPU and float32 on a CPU."""
    trust_remote_code: bool = False
    """Run model code shipped with a folder or hub model; off unless you trust its author."""


_SECTIONS: dict[str, type] = {}
"""The ``drafter.<name>`` sections, by name, in the order the kinds declared them."""
_SECTION_OF_KIND: dict[str, str | None] = {}
"""Every registered kind, and the section it reads (None: it has no options of its own)."""
_DEFAULT_KIND: list[str] = []
"""The kind a run config trains when it names none (declared by that kind)."""


def register_kind(kind: str, section: tuple[str, type] | None = None, default: bool = False) -> None:
    """Declare that ``kind`` reads the run config's ``drafter.<name>`` section, a frozen dataclass
    (``section = (name, dataclass)``; kinds of one family share one), and whether it is the kind a run
    config trains when ``drafter.kind`` is not given. Called by the kind registry
    (``selfdraft.heads.registry.register``): this is how a kind's folder declares its options and their
    checks without this module naming it."""
    if section is not None:
        name, cls = section
        if _SECTIONS.get(name, cls) is not cls:
            raise SelfdraftError(f"config section drafter.{name} is already declared as {_SECTIONS[name].__name__}")
        if name in ("kind", "tree"):
            raise SelfdraftError(f"drafter.{name} is not a section name a kind can declare")
    if default and _DEFAULT_KIND and _DEFAULT_KIND[0] != kind:
        raise SelfdraftError(f"{kind!r} cannot be the default drafter kind: {_DEFAULT_KIND[0]!r} is")
    if section is not None:
        _SECTIONS[section[0]] = section[1]
    _SECTION_OF_KIND[kind] = None if section is None else section[0]
    if default:
        _DEFAULT_KIND[:] = [kind]


def unregister_kind(kind: str) -> None:
    """Undo :func:`register_kind`; the kind's section goes once no kind reads it."""
    name = _SECTION_OF_KIND.pop(kind, None)
    if name is not None and name not in _SECTION_OF_KIND.values():
        del _SECTIONS[name]
    if _DEFAULT_KIND == [kind]:
        _DEFAULT_KIND.clear()


def default_kind() -> str:
    """The kind a run config trains when ``drafter.kind`` is not given."""
    drafter_sections()
    if not _DEFAULT_KIND:
        raise SelfdraftError("no registered drafter kind is the default: give drafter.kind")
    return _DEFAULT_KIND[0]


def drafter_sections() -> dict[str, type]:
    """The ``drafter.<name>`` sections of the registered kinds. configs sits below heads, so the kinds
    that ship with selfdraft are imported here by name, once: they register their sections on import."""
    importlib.import_module("selfdraft.heads.kinds")
    return dict(_SECTIONS)


def section_of_kind(kind: str) -> str | None:
    """The section name the registered ``kind`` reads, or None."""
    drafter_sections()
    return _SECTION_OF_KIND.get(kind)


class DrafterConfig:
    """The drafter to train: its kind, its tree, and one section of options per family of kinds
    (``drafter.<section>``, declared by the kind's folder; every registered section is present, with its
    defaults where the file says nothing, so that a config lists every option it ran with). Immutable,
    like the dataclass sections around it."""

    kind: str
    """Which drafter to train: a registered kind (``selfdraft.heads.kinds`` lists them; the default is the
    kind that declares itself so); an unknown name is refused with the known ones."""
    tree: TreeConfig
    """The draft tree stored with the export as its decode default, and scored by the held-out
    evaluation's predicted acceptance length."""

    def __init__(self, kind: str | None = None, tree: TreeConfig | None = None, **sections):
        known = drafter_sections()
        unknown = sorted(set(sections) - set(known))
        if unknown:
            raise SelfdraftError(f"unknown drafter section{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                                 f"the registered kinds declare {', '.join(known)}")
        for name, cls in known.items():
            if sections.get(name) is not None and not isinstance(sections[name], cls):
                raise SelfdraftError(f"drafter.{name} must be a {cls.__name__}, got {type(sections[name]).__name__}")
        values = {"kind": default_kind() if kind is None else kind, "tree": TreeConfig() if tree is None else tree,
                  "sections": {name: sections.get(name) or cls() for name, cls in known.items()}}
        self.__dict__.update(values)

    def __getattr__(self, name: str):
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(f"drafter config has no section {name!r}; sections: {', '.join(sections)}")

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __eq__(self, other) -> bool:
        return type(other) is DrafterConfig and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        parts = [f"kind={self.kind!r}", f"tree={self.tree!r}"] + [f"{k}={v!r}" for k, v in self.sections.items()]
        return f"DrafterConfig({', '.join(parts)})"

    @classmethod
    def from_config_dict(cls, data: dict, prefix: str = "") -> "DrafterConfig":
        """Build it from a mapping (how :func:`~selfdraft.configs.schema.from_dict` builds a section),
        each section by its own dataclass: an unknown key is named by its dotted path."""
        known = drafter_sections()
        check_keys(data, {"kind", "tree", *known}, prefix)
        kind = data.get("kind", default_kind())
        if not isinstance(kind, str):
            raise SelfdraftError(f"config {prefix}kind: expected str, got {kind!r}")
        values = {name: from_dict(section, _mapping(data[name], prefix + name), prefix=f"{prefix}{name}.")
                  for name, section in known.items() if name in data}
        tree = from_dict(TreeConfig, _mapping(data["tree"], prefix + "tree"), prefix=f"{prefix}tree.") if "tree" in data else None
        return cls(kind=kind, tree=tree, **values)

    def to_config_dict(self) -> dict:
        return {"kind": self.kind, "tree": to_dict(self.tree), **{k: to_dict(v) for k, v in self.sections.items()}}


def _mapping(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise SelfdraftError(f"config {name}: expected a mapping, got {value!r}")
    return value


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation: steps, batches, schedule, evaluation, checkpoints and logging."""

    output_dir: str = "runs/medusa-smollm2"
    """Run folder: resolved config, checkpoints/, drafter/ (the native export), metrics.jsonl."""
    max_steps: int = 1000
    """Optimizer steps; with ``time_budget_minutes``, only the first plan of them."""
    time_budget_minutes: float | None = None
    """A deadline for the seconds spent in optimizer steps (loading, evaluation and saving come on
    top): the run re-plans its number of steps from the step times it measures, so that it fills the
    budget and ends by it, and the learning-rate schedule follows the plan
    (``selfdraft.train.deadline``). 0 or null: off, the run takes ``max_steps`` steps."""
    micro_batch_size: int = 4
    """Conversations per forward pass per process."""
    grad_accum: int = 1
    """Micro batches per optimizer step (global batch = micro_batch_size x grad_accum x processes)."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 20
    """Linear warm-up from 0 to lr, then cosine decay to min_lr_ratio x lr at max_steps."""
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    dist_timeout_minutes: float = 30.0
    """How long a process waits in a collective (a barrier, a gradient all-reduce) for the others before
    the run fails instead of hanging: raise it where one rank renders data or loads a large target while
    the others wait (multi-node runs), lower it to find a hang sooner."""
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] | None = None
    """Autocast through accelerate: unset (null) takes accelerate's own setting (its config file or
    ``accelerate launch --mixed_precision``; ``no`` outside a launch); a value here wins and is logged.
    bf16 only helps where the hardware has bf16 matmuls: ``auto`` picks bf16 on a GPU that has them and
    on a CPU with AVX-512 BF16 or AMX (``selfdraft.machine.cpu_has_bf16``), else no autocast (an
    AVX2-only CPU runs bf16 slower than fp32)."""
    seed: int = 0
    """Seeds the data order, the head initialisation and every RNG."""
    eval_every: int = 100
    """Evaluate on the held-out split every this many steps (and at the end); 0 only at the end."""
    eval_batches: int = 16
    """Micro batches per process per evaluation; 0 for the whole held-out split."""
    top_k: int = 5
    """Top-k accuracy reported next to top-1."""
    save_every: int = 100
    """Write a checkpoint every this many steps (and at the end); 0 only at the end."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted once a newer one is complete."""
    log_every: int = 10
    report_to: Literal["none", "wandb"] = "none"
    """Tracker for metrics through accelerate: wandb (offline by default) or none."""
    wandb_project: str = "selfdraft"
    wandb_mode: Literal["offline", "online"] = "offline"
    num_threads: int = 0
    """torch CPU threads per process; 0 leaves torch's default."""
    features: str = ""
    """A feature cache written by ``selfdraft features`` for this run's data and target, streamed
    instead of running the target in every step; empty computes the target's features online;
    ``auto`` writes a cache in ``output_dir/features`` first when the run reads its conversations
    (``data.max_conversations``) at least 1.25 times and the cache fits the disk and 20 GB, else
    online (``selfdraft.train.budget.resolve_features`` says which and why)."""
    data_dir: str = ""
    """Where the rendered train/eval split is kept. Empty: ``output_dir/data``, on the run's (shared)
    filesystem, rendered once by the global main process. A node-local path (e.g. /local/selfdraft-data):
    rendered once per node by that node's local main process, so no node waits on another's disk."""
    pack_tokens: int = 0
    """Pack each micro batch's conversations into rows of at most this many tokens (first-fit
    decreasing), with positions restarting at every conversation and attention kept within it (the
    target's and the drafter's), so the drafter computes no padding. 0: a right-padded row per
    conversation. The target runs each conversation unpadded either way on a CPU, and each packed row
    on a GPU (``train.features.target_features``). At least ``data.max_length`` when set; rows never mix
    micro batches, so the data order, the losses and the gradients are those of the unpacked batch (to
    float rounding). It pays where conversations are much shorter than the longest of their batch; the
    drafter's attention is dense over a row, so rows far longer than ``data.max_length`` cost more
    than the padding they save (by measurement: docs/results/training-profiles.md)."""
    render_processes: int = 1
    """Processes that render (tokenise) the conversations in parallel; the split is the same for any
    number."""


@dataclass(frozen=True)
class RunConfig:
    name: str = "medusa-smollm2"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        t = self.train
        checks = [
            (t.max_steps >= 1, "train.max_steps must be >= 1"),
            (t.time_budget_minutes is None or t.time_budget_minutes >= 0,
             "train.time_budget_minutes must be >= 0 (0 or null: no time budget)"),
            (t.micro_batch_size >= 1, "train.micro_batch_size must be >= 1"),
            (t.grad_accum >= 1, "train.grad_accum must be >= 1"),
            (t.lr > 0, "train.lr must be > 0"),
            (len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas must be two numbers in [0, 1)"),
            (t.warmup_steps >= 0, "train.warmup_steps must be >= 0"),
            (0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1]"),
            (t.max_grad_norm >= 0, "train.max_grad_norm must be >= 0"),
            (t.dist_timeout_minutes > 0, "train.dist_timeout_minutes must be > 0"),
            (t.render_processes >= 1, "train.render_processes must be >= 1"),
            (t.pack_tokens == 0 or t.pack_tokens >= self.data.max_length,
             "train.pack_tokens must be 0 (no packing) or at least data.max_length (a conversation never spans two rows)"),
            (min(t.eval_every, t.eval_batches, t.save_every, t.num_threads) >= 0, "train.eval_every, eval_batches, save_every and num_threads must be >= 0"),
            (t.keep_last >= 1, "train.keep_last must be >= 1"),
            (t.log_every >= 1, "train.log_every must be >= 1"),
            (t.top_k >= 1, "train.top_k must be >= 1"),
            (self.data.max_length >= 4, "data.max_length must be >= 4"),
        ]
        problems = [message for ok, message in checks if not ok]
        problems += [message for section in self.drafter.sections.values() for message in section.problems(self)]
        if problems:
            raise SelfdraftError(f"config: {problems[0]}")


def upgrade_config_dict(data: dict) -> tuple[dict, list[str]]:
    """A run config dict with selfdraft 0.1's tree keys moved to ``drafter.tree`` (those of the section
    that applies to its kind win; the other section's are dropped, as they never applied), and one
    line per key moved. Checkpoints and YAML files written before 0.2 load through it."""
    drafter = data.get("drafter")
    if not isinstance(drafter, dict):
        return data, []
    drafter = {k: dict(v) if isinstance(v, dict) else v for k, v in drafter.items()}
    own = section_of_kind(drafter.get("kind", default_kind()))
    tree, notes = dict(drafter.get("tree") or {}), []
    for section, cls in drafter_sections().items():
        for old, new in getattr(cls, "UPGRADED_KEYS", {}).items():
            values = drafter.get(section)
            if not (isinstance(values, dict) and old in values):
                continue
            value = values.pop(old)
            if section == own and new not in tree:
                tree[new] = value
            notes.append(f"drafter.{section}.{old} is now drafter.tree.{new}")
    if notes:
        drafter["tree"] = tree
    return {**data, "drafter": drafter}, notes


def presets() -> dict[str, pathlib.Path]:
    """Shipped run presets by name (the YAML files in ``configs/``)."""
    return {p.stem: p for p in sorted(PRESET_DIR.glob("*.yaml"))}


def load_run_config(config: str | pathlib.Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a preset name or YAML path, apply ``a.b=value`` overrides and validate the result."""
    data: dict = {}
    if config is not None:
        path = pathlib.Path(config)
        # A preset name wins over anything of that name that is not a YAML file: `selfdraft quickstart
        # --out quickstart` makes a folder called like the preset it then reloads.
        if not path.is_file() and str(config) in presets():
            path = presets()[str(config)]
        data = load_yaml(path)
    data, notes = upgrade_config_dict(data)
    for note in notes:
        logging.getLogger(__name__).warning("config %s: %s", config, note)
    data = apply_overrides(data, list(overrides))
    return from_dict(RunConfig, data)
