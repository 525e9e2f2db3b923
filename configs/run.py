"""The training run config: one YAML file with ``target``, ``data``, ``drafter`` and ``train`` sections.

Load it with :func:`load_run_config` (a preset name from this folder or a path, plus ``a.b=value``
overrides). Every key is checked: an unknown key or a value of the wrong type is an error naming the
dotted key. The resolved config (``to_dict``) is saved next to every checkpoint and export.
"""

from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass, field
from typing import Literal

from selfdraft.configs.decode import TreeConfig
from selfdraft.configs.schema import DataConfig, apply_overrides, from_dict, load_yaml
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


@dataclass(frozen=True)
class LoraConfig:
    """Medusa-2: joint training of the heads and LoRA adapters on the target (rank 0 = Medusa-1).

    With LoRA the target changes: the LoRA-merged model that the run exports is the target whose
    distribution the decoder preserves, not the original model.
    """

    rank: int = 0
    """LoRA rank; 0 keeps the target frozen (Medusa-1)."""
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Linear layers of the target that get adapters (names as in the model)."""
    lm_loss: Literal["kl", "ce"] = "kl"
    """The target's own loss in the combined objective: KL to the original (adapter-free) model's
    next-token distribution (keeps its answers), or cross-entropy on the data's tokens."""
    lm_loss_weight: float = 1.0
    """Weight of the target's own loss next to the heads' loss."""


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads: K heads of L residual blocks on the target's final hidden state."""

    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = False
    """Give every head its own vocabulary projection (K x V x D more weights) instead of the target's."""
    labels: Literal["target", "data"] = "target"
    """What head k at position t learns: the target's own distribution for token t+2+k (self-distilled
    soft labels, computed on the fly) or the data's token t+2+k (the Medusa paper's hard labels)."""
    position_fraction: float = 1.0
    """Share of eligible positions per head (drawn at random each step) that enter the training loss.
    Below 1 it trades positions per sequence for sequences per second where the vocabulary projection
    dominates the cost (a CPU); evaluation always uses every position."""
    head_decay: float = 0.8
    """Loss weight of head k is head_decay**k (later heads are harder and matter less)."""
    tree_ranks: int = 10
    """Top-ranks measured per head for the sparse tree (accuracy of rank r for r < tree_ranks); its node
    budget is ``drafter.tree.max_nodes``."""
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(frozen=True)
class EagleConfig:
    """EAGLE-1 (``kind: eagle``) and EAGLE-3 (``kind: eagle3``) feature drafters."""

    layer: Literal["llama", "target"] = "llama"
    """The draft decoder layer: a Llama layer shaped like the target (what vLLM and SGLang build for
    every EAGLE drafter, whatever the target's family: no q/k/v biases, no q/k norms), or the target
    family's own layer class (decodes here; engines cannot load it, and export to them is refused)."""

    regression_weight: float = 1.0
    """EAGLE-1: weight of the smooth-L1 regression of the next feature."""
    kl_weight: float = 0.1
    """EAGLE-1: weight of the KL to the target's next-token distribution (EAGLE-3 uses the KL alone)."""
    feature_noise: float = 0.1
    """EAGLE-1: uniform noise (+-feature_noise) added to input features while training."""
    ttt_steps: int = 3
    """EAGLE-3 training-time test: steps the drafter is unrolled on its own outputs."""
    step_decay: float = 0.8
    """EAGLE-3: loss weight of unrolled step j is step_decay**j."""
    draft_vocab_size: int = 8192
    """EAGLE-3: the most frequent target tokens (assistant tokens of the training data) it drafts from."""
    aux_layers: list[int] = field(default_factory=list)
    """EAGLE-3: the target layers fused, as transformers ``hidden_states`` indices (index i is the
    input of decoder layer i); empty for the engines' default (2, L//2, L-3). Exports translate them
    into each engine's own convention."""


@dataclass(frozen=True)
class BlockConfig:
    """Block drafters, DFlash (``kind: dflash``) and DSpark (``kind: dspark``): a whole block of tokens
    per drafter forward, conditioned on several target layers."""

    block_size: int = 4
    """Slots per block, the anchor included: DFlash drafts block_size - 1 tokens, DSpark block_size. 4 by
    measurement: docs/results/block-drafters.md."""
    num_layers: int = 1
    """Draft layers (Qwen3 layers shaped like the target). 1 by measurement: docs/results/block-drafters.md."""
    target_layers: list[int] = field(default_factory=list)
    """The fused target layers, as transformers ``hidden_states`` indices (i + 1 is decoder layer i's
    output); empty: three spread from the second layer to the fourth-last, as z-lab's DFlash picks them.
    Exports translate them into each engine's convention."""
    draft_vocab_size: int = 8192
    """The most frequent assistant tokens of the training data it drafts from, through its own LM head
    (rows of the target's to start); the target's vocabulary size: through the target's frozen head."""
    mask_token_id: int | None = None
    """The token fed at every slot after the anchor; unset: the largest id that is not the target's
    bos/eos/pad and never occurs in the training data. A token of the training data is refused."""
    anchors: int = 64
    """Blocks per sequence and step, their anchors drawn at random among assistant positions."""
    loss_decay: float = 4.0
    """gamma: the loss weight of the j-th drafted token is exp(-j / gamma)."""
    markov_rank: int = 64
    """DSpark: rank r of the Markov head."""
    confidence_head: bool = True
    """DSpark: train the confidence head (each slot's probability of being accepted)."""
    confidence_weight: float = 1.0
    """DSpark: weight of the confidence head's loss (binary cross-entropy against 1 - total variation
    between the drafter's and the target's distributions at that slot)."""


@dataclass(frozen=True)
class DrafterConfig:
    kind: str = "medusa"
    """Which drafter to train: a registered kind (``medusa``, ``eagle`` for EAGLE-1, ``eagle3``, ``dflash``, ``dspark``;
    ``selfdraft.heads.kinds`` lists them); an unknown name is refused with the known ones."""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """The draft tree stored with the export as its decode default, and scored by the held-out
    evaluation's predicted acceptance length."""
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)
    """Options of the EAGLE kinds (``eagle`` and ``eagle3``)."""
    block: BlockConfig = field(default_factory=BlockConfig)
    """Options of the block kinds (``dflash`` and ``dspark``)."""


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
        t, m = self.train, self.drafter.medusa
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
            (m.num_heads >= 1 and m.num_layers >= 0, "drafter.medusa needs num_heads >= 1 and num_layers >= 0"),
            (0 < m.position_fraction <= 1, "drafter.medusa.position_fraction must be in (0, 1]"),
            (0 < m.head_decay <= 1, "drafter.medusa.head_decay must be in (0, 1]"),
            (m.tree_ranks >= 1, "drafter.medusa.tree_ranks must be >= 1"),
            (m.lora.rank >= 0 and m.lora.lm_loss_weight >= 0, "drafter.medusa.lora.rank and lm_loss_weight must be >= 0"),
            (self.data.max_length >= 4, "data.max_length must be >= 4"),
            (self.drafter.eagle.ttt_steps >= 1 and 0 < self.drafter.eagle.step_decay <= 1,
             "drafter.eagle needs ttt_steps >= 1 and step_decay in (0, 1]"),
            (self.drafter.eagle.draft_vocab_size >= 2, "drafter.eagle.draft_vocab_size must be >= 2"),
            (self.drafter.block.block_size >= 2 and self.drafter.block.num_layers >= 1 and self.drafter.block.anchors >= 1,
             "drafter.block needs block_size >= 2, num_layers >= 1 and anchors >= 1"),
            (self.drafter.block.block_size < self.data.max_length,
             f"drafter.block.block_size {self.drafter.block.block_size} must be below data.max_length {self.data.max_length}"),
            (self.drafter.block.draft_vocab_size >= 2 and self.drafter.block.markov_rank >= 1, "drafter.block needs draft_vocab_size >= 2 and markov_rank >= 1"),
            (self.drafter.block.loss_decay > 0 and self.drafter.block.confidence_weight >= 0, "drafter.block needs loss_decay > 0 and confidence_weight >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise SelfdraftError(f"config: {message}")


_MOVED_TREE_KEYS = {("eagle", "tree_depth"): "depth", ("eagle", "tree_top_k"): "top_k", ("eagle", "tree_nodes"): "max_nodes",
                    ("medusa", "tree_nodes"): "max_nodes"}
"""Tree keys of configs written by selfdraft 0.1 (``drafter.eagle.tree_*``, ``drafter.medusa.tree_nodes``),
now ``drafter.tree.*``."""
_SECTION_OF_0_1_KIND = {"medusa": "medusa", "eagle": "eagle", "eagle3": "eagle"}
"""Which section's tree keys applied to each of selfdraft 0.1's kinds."""


def upgrade_config_dict(data: dict) -> tuple[dict, list[str]]:
    """A run config dict with selfdraft 0.1's tree keys moved to ``drafter.tree`` (those of the section
    that applies to its kind win; the other section's are dropped, as they never applied), and one
    line per key moved. Checkpoints and YAML files written before 0.2 load through it."""
    drafter = data.get("drafter")
    if not isinstance(drafter, dict):
        return data, []
    drafter = {k: dict(v) if isinstance(v, dict) else v for k, v in drafter.items()}
    section_of_kind = _SECTION_OF_0_1_KIND.get(drafter.get("kind", DrafterConfig.kind))
    tree, notes = dict(drafter.get("tree") or {}), []
    for (section, old), new in _MOVED_TREE_KEYS.items():
        values = drafter.get(section)
        if isinstance(values, dict) and old in values:
            value = values.pop(old)
            if section == section_of_kind and new not in tree:
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
