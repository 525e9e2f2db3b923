"""The target's features for training: computed online in every step, or precomputed once to disk.

A drafter learns from the target's hidden states: the final normed state (Medusa, EAGLE-1; the
target's logits are its LM head applied to it) and, for EAGLE-3, three inner layers. The target is
frozen, so these states are a pure function of the conversation. ``target_features`` runs the
target on each conversation of a batch on its own, unpadded, so a conversation's features never
depend on which others share its batch. ``selfdraft features`` writes the same tensors to a sharded
cache and a run with ``train.features=DIR`` streams them instead of running the target: both
paths give the same training batches, bit for bit when the cache keeps the target's dtype
(``--dtype bfloat16`` halves the disk and rounds the features; packed rows on a GPU, where the target
runs once per row, round too).

Layout of a cache folder::

    features.json                     what it holds: target, rendered data, layers, dtype, the plan
    train/shard-00000.safetensors     features (tokens, layers, hidden), offsets (n + 1,) int64,
    ...                               examples (n,) int64: example indices of the rendered split
    eval/shard-00000.safetensors

The plan (which examples go in which shard) is fixed before the first shard is written; shards
are written atomically, one at a time, so a rerun with the same settings skips the finished ones.
With ``--steps N`` only the training examples that the first N optimizer steps visit are cached
(the data order is a pure function of the seed, see ``batches.stream_index``); ``--processes P`` is the
process count of the run that will train from the cache, since the visit order depends on it.

Several processes write one cache together (``accelerate launch -m selfdraft.features ...``): all
make the same plan and size check, the main process writes ``features.json``, and process r of W
writes the unfinished shards r, r + W, ... The layout depends only on the settings, not on W, so the
files are the same whichever number of processes wrote them, and any number resumes an
interrupted write.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from typing import Any, Literal

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.files import as_if_created
from selfdraft.train.batches import check_context, data_key, prepare_data, stream_index
from selfdraft.train.distributed import fresh_accelerate_state, process_group_handlers, resolve_mixed_precision

MANIFEST = "features.json"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class FeatureSource:
    """Where a run's target features come from: ``train.features`` parsed.

    * ``online``: the target runs in every step (``train.features`` empty);
    * ``auto``: decided before the run starts (``selfdraft.train.budget.resolve_features``): a cache
      in ``output_dir/features`` when the run reads its conversations often enough, else online;
    * ``cache``: the feature cache in folder ``path``, written by ``selfdraft features``.
    """

    kind: Literal["online", "auto", "cache"]
    path: pathlib.Path | None = None

    AUTO = "auto"
    """The ``train.features`` value that asks for ``auto``."""

    @classmethod
    def parse(cls, value: str | os.PathLike | None) -> FeatureSource:
        if value is None or str(value) == "":
            return cls("online")
        if str(value) == cls.AUTO:
            return cls("auto")
        return cls("cache", pathlib.Path(value))

    def __str__(self) -> str:
        """The ``train.features`` value that parses to this source."""
        return {"online": "", "auto": self.AUTO}.get(self.kind, str(self.path))


def feature_layers(config, num_layers: int) -> list[int]:
    """The ``hidden_states`` indices the run's drafter kind trains on (from the registry); the last one
    is always the final normed state (index ``num_layers``), from which the target's logits are
    recomputed."""
    from selfdraft.heads.kinds import get_kind

    return get_kind(config.drafter.kind).feature_layers(config, num_layers)


@torch.no_grad()
def target_features(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    layers: list[int], position_ids: torch.Tensor | None = None,
                    per_conversation: bool | None = None) -> torch.Tensor:
    """(B, T, len(layers), H) hidden states of a batch, zeros on padding.

    Rows hold their tokens first, then their padding. Unpacked (``position_ids`` None), a row is one
    conversation, run through the target alone and unpadded, so its features do not depend on the
    batch it is in. Packed (``position_ids`` restarting at every conversation, ``batches.collate``):

    * ``per_conversation`` (the default on a CPU): each conversation of a row runs alone, as unpacked,
      and its features are the same bits. On a CPU attention is dense whatever the mask, so a row of
      several conversations would pay attention across all of them only to mask it away.
    * else (the default on a GPU): one forward over all rows, whose masks (:func:`packed_masks`, the
      decoder's per layer kind) keep attention within each conversation (a row's trailing padding is a
      block of its own); features equal the conversation's own forward's to float rounding. A target
      with recurrent layers (whose state would carry into the next conversation) runs each conversation
      alone, as on a CPU.

    Every process of a run runs the same number of forwards for batches of the same number of
    conversations (one per conversation, or one per batch), as ZeRO-3's collective gathers need. The
    LM head runs on the last position only."""
    B, T = input_ids.shape
    if per_conversation is None:
        per_conversation = input_ids.device.type == "cpu"
    masks = None
    if position_ids is not None and not per_conversation:
        masks = packed_masks(model, position_ids)
        per_conversation = masks is False  # recurrent layers: a packed row cannot run as one forward
    if position_ids is not None and not per_conversation:
        states = model(input_ids=input_ids, position_ids=position_ids, attention_mask=masks, output_hidden_states=True,
                       use_cache=False, logits_to_keep=1).hidden_states
        out = torch.stack([states[i] for i in layers], dim=2)  # (B, T, layers, H)
        return out * attention_mask[:, :, None, None].to(out.dtype)
    spans: list[tuple[int, int, int]] = []  # (row, start, end) of each conversation
    for b, n in enumerate(attention_mask.sum(1).tolist()):
        if n == 0:
            continue
        if position_ids is None:
            spans.append((b, 0, n))
        else:
            starts = (position_ids[b, :n] == 0).nonzero().flatten().tolist() + [n]
            spans += [(b, s, e) for s, e in zip(starts, starts[1:])]
    out: torch.Tensor | None = None
    for b, start, end in spans:
        states = model(input_ids=input_ids[b:b + 1, start:end], output_hidden_states=True, use_cache=False,
                       logits_to_keep=1).hidden_states
        row = torch.stack([states[i][0] for i in layers], dim=1)  # (n, layers, H)
        if out is None:
            out = row.new_zeros(B, T, len(layers), row.shape[-1])
        out[b, start:end] = row
    if out is None:
        raise SelfdraftError("a batch without a single token")
    return out


def packed_masks(model: torch.nn.Module, position_ids: torch.Tensor):
    """The attention masks of one forward over packed rows (``position_ids`` (B, T) restarting at every
    conversation; a row's trailing padding restarts too, a block of its own), or False where the target
    cannot run packed rows as one forward, or None to let transformers find the conversations.

    transformers keeps attention within each conversation only where the model builds its masks from
    ``position_ids`` itself, which not every family does alike (GPT-OSS's features read across
    conversations that way, by up to 3 on a tiny random model: tests/test_family_training.py), and a
    recurrent layer (linear attention, state space, convolution)
    carries its state from one conversation into the next whatever the mask. So the masks are the
    decoder's own (:class:`~selfdraft.heads.target_layers.TargetLayers`, per layer kind, windows by
    position): each token sees the earlier tokens of its own conversation; a target with recurrent
    layers gets False (each conversation then runs alone). A model whose layers selfdraft cannot read
    (flash attention: it packs by ``position_ids`` itself) gets None."""
    from selfdraft.heads.target_layers import TargetLayers

    try:
        layers = TargetLayers.of(model)
    except SelfdraftError:
        return None
    if layers.recurrent:
        return False
    segment = torch.cumsum((position_ids == 0).long(), dim=1)  # (B, T): the conversation of each slot
    index = torch.arange(position_ids.shape[1], device=position_ids.device)
    visible = (segment[:, :, None] == segment[:, None, :]) & (index[None, None, :] <= index[None, :, None])  # (B, T, T)
    dtype = next(model.parameters()).dtype
    return layers.masks(visible, position_ids, position_ids, dtype)


# ----------------------------------------------------------------------------------------------
# Writing a cache


def _visited(n: int, steps: int, global_batch: int, seed: int) -> list[int]:
    """Training example indices the first ``steps`` optimizer steps visit, in first-visit order."""
    seen: dict[int, None] = {}
    for position in range(steps * global_batch):
        seen.setdefault(stream_index(position, n, seed), None)
    return list(seen)


def _chunks(indices: list[int], lengths: list[int], shard_tokens: int) -> list[list[int]]:
    shards, current, tokens = [], [], 0
    for i in indices:
        current.append(i)
        tokens += lengths[i]
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    return shards


def _online_cost(folder, train_tokens: int, identity) -> str:
    """`` (about N target forward FLOPs for this data)``: what online features cost in compute instead of
    disk, from the target's config (2 x parameters per token); empty when the config is not at hand."""
    try:
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(str(folder)).get_text_config() if folder is not None else None
    except (OSError, ValueError):
        text = None
    if text is None:
        return ""
    H, L, V = text.hidden_size, text.num_hidden_layers, text.vocab_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or H // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    inter = getattr(text, "intermediate_size", 4 * H)
    per_layer = H * head_dim * heads * 2 + H * head_dim * kv * 2 + 3 * H * inter
    params = L * per_layer + V * H  # the LM head runs; the embedding is a lookup
    return (f" (the target's forwards over this data's {train_tokens:,} training tokens: about "
            f"{2 * params * train_tokens / 1e12:,.1f} TFLOP per epoch, {params / 1e9:.2f} B multiply-adds per token)")


def _diff(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


@dataclasses.dataclass(frozen=True)
class CacheSize:
    """What a feature cache takes on disk, against what it may take."""

    total_gb: float
    """The whole cache."""
    todo_gb: float
    """Its shards not written yet."""
    free_gb: float
    """Free disk where it goes (the main process's reading)."""
    max_gb: float
    """The most it may take."""

    @property
    def fits(self) -> bool:
        return self.total_gb <= self.max_gb and self.todo_gb <= self.free_gb

    def shortfall(self) -> str:
        """Why it does not fit (empty when it does)."""
        if self.total_gb > self.max_gb:
            return f"the feature cache needs {self.total_gb:.2f} GB, more than --max-gb {self.max_gb:g}"
        if self.todo_gb > self.free_gb:
            return f"the feature cache needs {self.todo_gb:.2f} GB more and the disk has {self.free_gb:.1f} GB free"
        return ""


@dataclasses.dataclass(frozen=True)
class CacheOutcome:
    """What :func:`cache_features` did."""

    folder: pathlib.Path
    size: CacheSize
    refusal: str = ""
    """Why nothing was written, with what to do instead (empty when the cache was written)."""

    @property
    def written(self) -> bool:
        return not self.refusal


def write_features(config, out: str | os.PathLike | None = None, **options) -> pathlib.Path:
    """:func:`cache_features`, raising its refusal when the cache does not fit (nothing written then);
    returns the cache folder."""
    outcome = cache_features(config, out, **options)
    if not outcome.written:
        raise SelfdraftError(outcome.refusal)
    return outcome.folder


def cache_features(config, out: str | os.PathLike | None = None, *, max_gb: float = 20.0, dtype: str = "auto",
                   steps: int | None = None, processes: int = 1, shard_tokens: int = 1 << 16,
                   layers: list[int] | None = None, stop_after_shards: int | None = None,
                   cpu: bool = False) -> CacheOutcome:
    """Precompute the target's features for ``config``'s data into ``out`` (default: the run folder's
    ``features/``); see the module docstring. ``steps`` limits the training split to the examples
    the first ``steps`` optimizer steps visit with ``processes`` processes. Writes nothing, and says
    why in the outcome, when the cache would take more than ``max_gb`` GB or more than the free disk
    space: the size is known from the rendered data before the target's weights load. ``cpu``
    computes on the CPU even where there is a GPU. ``stop_after_shards`` stops this process after
    that many shards (as an interruption would), for tests.

    Under ``accelerate launch`` the processes share the unfinished shards; every check before the
    first write runs on all of them alike (the free disk is the main process's reading), so all
    decide the same, rather than leaving some waiting for the others."""
    from accelerate.utils import broadcast_object_list

    from selfdraft.heads.target import load_target, load_target_tokenizer, resolve_dtype

    t = config.train
    out = pathlib.Path(out) if out is not None else pathlib.Path(t.output_dir) / "features"
    accelerator = _accelerator(config, cpu)
    main, rank, world = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes
    # The plan and its size come from the config, the tokenizer and the rendered data: the weights are
    # loaded only once the cache is known to fit.
    tokenizer, identity = load_target_tokenizer(config.target.spec, trust_remote_code=config.target.trust_remote_code)
    target_dtype = resolve_dtype(config.target.dtype, accelerator.device)
    num_layers, hidden = identity.num_layers, identity.hidden_size
    layers, store = _layers_and_dtype(config, layers, num_layers, dtype, target_dtype)
    train_data, eval_data = prepare_data(config, tokenizer, accelerator)
    if not train_data:
        raise SelfdraftError("the training split is empty: nothing to precompute")
    train_idx = (_visited(len(train_data), steps, t.micro_batch_size * t.grad_accum * processes, t.seed)
                 if steps else list(range(len(train_data))))
    splits = {"train": (train_data, train_idx), "eval": (eval_data, list(range(len(eval_data))))}
    plan = {name: _chunks(idx, [len(x) for x, _ in data], shard_tokens) for name, (data, idx) in splits.items()}
    key: dict[str, Any] = {
        "format": FORMAT_VERSION, "target": identity.to_dict(), "target_dtype": str(target_dtype),
        "data": data_key(config, tokenizer), "layers": layers, "dtype": str(store).removeprefix("torch."),
        "hidden_size": int(hidden),
        "coverage": {"steps": steps, "global_batch": t.micro_batch_size * t.grad_accum * processes, "seed": t.seed},
        "plan": plan,
    }
    manifest = out / MANIFEST
    _check_manifest(out, key)
    tokens = {name: sum(len(data[i][0]) for i in idx) for name, (data, idx) in splits.items()}
    per_token = len(layers) * hidden * store.itemsize
    shard_path = {(name, s): out / name / f"shard-{s:05d}.safetensors" for name in plan for s in range(len(plan[name]))}
    todo = [(name, s) for (name, s), path in shard_path.items() if not path.is_file()]
    todo_tokens = sum(len(splits[name][0][i][0]) for name, s in todo for i in plan[name][s])
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())  # the folder may not exist yet
    # The main process's reading for all: processes reading at different moments could decide differently.
    size = CacheSize(total_gb=sum(tokens.values()) * per_token / 1e9, todo_gb=todo_tokens * per_token / 1e9,
                     free_gb=broadcast_object_list([shutil.disk_usage(existing).free / 1e9])[0], max_gb=max_gb)
    if main:
        print(f"feature cache {out} for {identity.name} ({num_layers} layers, hidden {hidden}): {len(train_idx)} train + "
              f"{len(eval_data)} eval conversations, {sum(tokens.values())} tokens x {len(layers)} layers {layers} x "
              f"{hidden} in {key['dtype']}: {size.total_gb:.2f} GB ({size.todo_gb:.2f} GB left to write, "
              f"{size.free_gb:.1f} GB free); {len(todo)} of {len(shard_path)} shards to write by {world} "
              f"process{'es' if world > 1 else ''}")
    if not size.fits:
        return CacheOutcome(out, size, refusal=_refusal(size, config, tokens["train"], identity, store))
    target = load_target(config.target.spec, dtype=config.target.dtype, device=str(accelerator.device),
                         trust_remote_code=config.target.trust_remote_code, small_batch_kernel=False)  # whole sequences only
    if target.identity != identity or target.model.dtype != target_dtype:
        raise SelfdraftError(f"target {config.target.spec} loaded as {target.identity} in {target.model.dtype}, "
                             f"planned as {identity} in {target_dtype}")
    check_context(config, target.max_context)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(key), encoding="utf-8")
        os.replace(tmp, manifest)
    accelerator.wait_for_everyone()
    # Every process computed the same todo before any shard was written; each takes every world-th.
    mine = todo[rank::world][:stop_after_shards]
    _write_shards(accelerator, target.model, {shard_path[name, s]: (splits[name][0], plan[name][s]) for name, s in mine},
                  layers, store)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return CacheOutcome(out, size)


def _accelerator(config, cpu: bool):
    """The process's accelerator, as the run makes it (threads, autocast, collective timeout), with the
    built-in target converted (once per node)."""
    from accelerate import Accelerator

    from selfdraft.heads.target import target_folder

    t = config.train
    if t.num_threads:  # as the run computes its online features
        torch.set_num_threads(t.num_threads)
    handlers = process_group_handlers(t.dist_timeout_minutes)
    if not handlers:  # not launched: this call owns the process
        fresh_accelerate_state()
    # The run's autocast too: its online features are computed under it.
    accelerator = Accelerator(cpu=cpu or not torch.cuda.is_available(),
                              mixed_precision=resolve_mixed_precision(t.mixed_precision, cpu), kwargs_handlers=handlers)
    with accelerator.local_main_process_first():
        target_folder(config.target.spec)
    return accelerator


def _layers_and_dtype(config, layers: list[int] | None, num_layers: int, dtype: str, target_dtype: torch.dtype):
    """The hidden_states indices to cache (the final normed state always among them) and the dtype to
    store them in."""
    layers = sorted(set(layers) | {num_layers}) if layers else feature_layers(config, num_layers)
    if not all(0 <= i <= num_layers for i in layers):
        raise SelfdraftError(f"layers {layers} out of range for a target with {num_layers} layers")
    store = target_dtype if dtype == "auto" else getattr(torch, dtype, None)
    if not isinstance(store, torch.dtype) or not store.is_floating_point:
        raise SelfdraftError(f"--dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return layers, store


def _check_manifest(out: pathlib.Path, key: dict) -> None:
    """A cache folder already there must be for these settings (it is then continued)."""
    manifest = out / MANIFEST
    if manifest.is_file():
        old = json.loads(manifest.read_text(encoding="utf-8"))
        if old != key:
            raise SelfdraftError(f"{out} holds a feature cache for other settings ({', '.join(_diff(old, key))} differ): "
                                 "remove it or choose another --out")


def _refusal(size: CacheSize, config, train_tokens: int, identity, store: torch.dtype) -> str:
    """Why a cache that does not fit is not written, and what to do instead."""
    from selfdraft.heads.target import target_folder

    online = _online_cost(target_folder(config.target.spec), train_tokens, identity)
    fixes = [f"raise --max-gb (now {size.max_gb:g})" if size.total_gb > size.max_gb else "free disk space"]
    if store.itemsize > 2:
        fixes.append("store --dtype bfloat16 (half the size)")
    fixes += ["cache fewer --steps", "or lower data.max_conversations"]
    return (f"{size.shortfall()}. Train with online features instead (leave train.features unset): the run then "
            f"computes them with the target's forward in every step and needs no disk{online}. Else {', '.join(fixes)}.")


def _write_shards(accelerator, model, shards: dict, layers: list[int], store: torch.dtype) -> None:
    """Compute and write each shard (path -> (the split's examples, the shard's example indices)), each
    written whole or not at all (a ``.tmp`` renamed into place), so an interrupted run resumes by shard."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    progress = tqdm(total=sum(len(data[i][0]) for data, indices in shards.values() for i in indices),
                    desc="target features", unit="tok", unit_scale=True, disable=not accelerator.is_main_process)
    for path, (data, indices) in shards.items():
        rows = []
        for i in indices:
            ids = torch.from_numpy(data[i][0])[None].to(accelerator.device)
            with accelerator.autocast():
                rows.append(target_features(model, ids, torch.ones_like(ids), layers)[0].to(store).cpu())
            progress.update(ids.shape[1])
        offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".tmp")
        save_file({"features": torch.cat(rows).contiguous(), "offsets": offsets,
                   "examples": torch.tensor(indices, dtype=torch.int64)}, str(part))
        as_if_created(part)
        os.replace(part, path)
    progress.close()


# ----------------------------------------------------------------------------------------------
# Reading a cache


class FeatureCache:
    """A finished feature cache, checked against the run that streams it."""

    def __init__(self, folder: str | os.PathLike, *, identity, data: dict, layers: list[int]):
        self.folder = pathlib.Path(folder)
        manifest = self.folder / MANIFEST
        if not manifest.is_file():
            raise SelfdraftError(f"train.features: {self.folder} is not a feature cache (no {MANIFEST}); "
                                 "write one with `selfdraft features --config ...`")
        try:
            self.key = json.loads(manifest.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise SelfdraftError(f"train.features: {manifest} is corrupt: {err}") from err
        if self.key.get("format") != FORMAT_VERSION:
            raise SelfdraftError(f"train.features: {self.folder} has format {self.key.get('format')}, this selfdraft reads {FORMAT_VERSION}")
        from selfdraft.heads.target import TargetIdentity

        cached = TargetIdentity.from_dict(self.key["target"])
        wrong = identity.mismatches(cached) + ([f"target: {identity.name} here, {cached.name} in the cache"]
                                               if cached.name != identity.name else [])
        if wrong:
            raise SelfdraftError(f"train.features: {self.folder} was computed with another target: {'; '.join(wrong)}")
        if self.key["data"] != data:
            raise SelfdraftError(f"train.features: {self.folder} was computed for other data "
                                 f"({', '.join('data.' + k for k in _diff(self.key['data']['data'], data['data'])) or 'the tokenizer'} differ)")
        missing = [i for i in layers if i not in self.key["layers"]]
        if missing:
            raise SelfdraftError(f"train.features: {self.folder} holds layers {self.key['layers']}, this run needs {layers}")
        self.select = torch.tensor([self.key["layers"].index(i) for i in layers])
        self._where: dict[str, dict[int, tuple[pathlib.Path, int]]] = {}
        unfinished = []
        for split, shards in self.key["plan"].items():
            where = self._where.setdefault(split, {})
            for s, examples in enumerate(shards):
                path = self.folder / split / f"shard-{s:05d}.safetensors"
                if not path.is_file():
                    unfinished.append(path.name)
                where.update({i: (path, j) for j, i in enumerate(examples)})
        if unfinished:
            raise SelfdraftError(f"train.features: {self.folder} is unfinished ({len(unfinished)} shards missing): "
                                 "rerun the same `selfdraft features` command to complete it")
        self._open: dict[pathlib.Path, tuple[Any, torch.Tensor]] = {}

    def check_covers(self, split: str, indices) -> None:
        """Raise unless every example index of ``split`` in ``indices`` is cached."""
        where = self._where.get(split, {})
        absent = [i for i in indices if i not in where]
        if absent:
            cov = self.key["coverage"]
            raise SelfdraftError(f"train.features: {len(absent)} {split} examples this run visits are not in {self.folder} "
                                 f"(it covers {cov['steps'] or 'all'} steps of global batch {cov['global_batch']}, seed "
                                 f"{cov['seed']}): rerun `selfdraft features` with --steps covering train.max_steps and --processes "
                                 "equal to the run's process count (the global batch, and so the visit order, "
                                 "depends on it)")

    def steps_covered(self, n: int, global_batch: int, seed: int) -> int | None:
        """How many optimizer steps of global batch ``global_batch`` over a training split of ``n``
        examples find every example they visit here; None when the cache holds the whole split."""
        where = self._where.get("train", {})
        if all(i in where for i in range(n)):
            return None
        position = 0  # an absent example comes within the first epoch: each epoch visits all n
        while stream_index(position, n, seed) in where:
            position += 1
        return position // global_batch

    def get(self, split: str, index: int) -> torch.Tensor:
        """(tokens, layers, H) features of example ``index`` of ``split``, the run's layers in order."""
        from safetensors import safe_open

        try:
            path, j = self._where[split][index]
        except KeyError:
            self.check_covers(split, [index])
            raise
        if path not in self._open:
            try:
                handle = safe_open(str(path), framework="pt")
                self._open[path] = (handle, handle.get_tensor("offsets"))
            except Exception as err:  # safetensors raises its own error types for a damaged file
                raise SelfdraftError(f"train.features: cannot read {path}: {err}") from err
        handle, offsets = self._open[path]
        a, b = int(offsets[j]), int(offsets[j + 1])
        return handle.get_slice("features")[a:b].index_select(1, self.select)

    def batch(self, split: str, indices: list[int], length: int, device, dtype: torch.dtype | None = None,
              placement: list[tuple[int, int]] | None = None, rows: int | None = None) -> torch.Tensor:
        """(rows, length, layers, H) features of several examples laid out as ``collate`` lays out their
        ids: example i at row ``placement[i][0]`` from position ``placement[i][1]`` (default: a row
        each, from 0); zeros elsewhere."""
        found = [self.get(split, i) for i in indices]
        placement = placement or [(b, 0) for b in range(len(found))]
        out = found[0].new_zeros(rows or len(found), length, *found[0].shape[1:])
        for (r, start), row in zip(placement, found):
            out[r, start:start + len(row)] = row
        return out.to(device=device, dtype=dtype or out.dtype)


def open_feature_cache(config, target, layers: list[int]) -> FeatureCache:
    """The cache ``train.features`` names, checked against the run's target, data and layers."""
    source = FeatureSource.parse(config.train.features)
    if source.kind != "cache":
        raise SelfdraftError(f"train.features is {str(source) or 'empty'}: no feature cache to open")
    return FeatureCache(source.path, identity=target.identity, data=data_key(config, target.tokenizer), layers=layers)
