"""The training data as the loop sees it: the rendered split on disk, its seeded order, its batches.

Data order is a pure function of (seed, step): global batch s takes positions [s*G, (s+1)*G) of an
endless stream of per-epoch permutations (:func:`stream_index`), and process r of P takes micro batch
m's slice r (:func:`batch_positions`). A resumed run therefore sees exactly the batches the
uninterrupted run would have seen, and a feature cache knows which examples a number of steps visits.

A batch (:func:`collate`, :func:`make_batch`) is a dict of (R, T) tensors: R rows of T positions,
a row per conversation, or with packing several conversations per row (:func:`pack_rows`).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

import numpy as np
import torch

from selfdraft.configs.run import RunConfig
from selfdraft.configs.schema import to_dict
from selfdraft.errors import SelfdraftError

MIN_BATCH_LENGTH = 3
"""Every batch has at least this many positions (EAGLE pairs a feature at t with tokens t+1 and t+2),
so that no objective has to skip a batch, which under ZeRO-3 would desynchronise the processes."""


# ----------------------------------------------------------------------------------------------
# The rendered split


def data_key(config: RunConfig, tokenizer) -> dict[str, Any]:
    """What the rendered train/eval split is a function of."""
    from selfdraft.heads.target import tokenizer_fingerprint

    return {"data": to_dict(config.data), "tokenizer": tokenizer_fingerprint(tokenizer)}


def data_folder(config: RunConfig) -> pathlib.Path:
    """The folder of the rendered split: ``train.data_dir`` (node-local) or ``output_dir/data`` (shared)."""
    return pathlib.Path(config.train.data_dir or pathlib.Path(config.train.output_dir) / "data")


def check_context(config: RunConfig, max_context: int) -> None:
    """A conversation of ``data.max_length`` tokens must fit the target's context: past its
    ``max_position_embeddings`` the features would come from positions the target never learned
    (RoPE computes them silently)."""
    if config.data.max_length > max_context:
        raise SelfdraftError(f"data.max_length {config.data.max_length} is longer than the target's context "
                             f"({max_context} positions, its max_position_embeddings): set data.max_length <= {max_context}")


def prepare_data(config: RunConfig, tokenizer, accelerator) -> tuple[list, list]:
    """Render (or reload) the train/eval split in :func:`data_folder`; returns lists of (input_ids,
    loss_mask) int arrays.

    One process per filesystem renders: the global main process for the run's own folder, each node's
    local main process for a node-local ``train.data_dir``; the others wait (at most
    ``train.dist_timeout_minutes``) and read it."""
    import datasets

    from selfdraft.train.data import build_datasets

    key = data_key(config, tokenizer)
    folder = data_folder(config)
    marker = folder / "fingerprint.json"
    renders = accelerator.is_local_main_process if config.train.data_dir else accelerator.is_main_process
    if renders:
        fresh = not (marker.is_file() and json.loads(marker.read_text()) == key)
        if fresh:
            train_ds, eval_ds = build_datasets(config.data, tokenizer, processes=config.train.render_processes)
            work = folder.parent / f".{folder.name}.tmp"
            shutil.rmtree(work, ignore_errors=True)
            train_ds.save_to_disk(str(work / "train"))
            eval_ds.save_to_disk(str(work / "eval"))
            (work / "fingerprint.json").write_text(json.dumps(key))
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(work, folder)
    accelerator.wait_for_everyone()

    def load(name):
        ds = datasets.load_from_disk(str(folder / name)).with_format("numpy")
        return [(np.asarray(r["input_ids"], dtype=np.int64), np.asarray(r["loss_mask"], dtype=np.int64)) for r in ds]

    return load("train"), load("eval")


# ----------------------------------------------------------------------------------------------
# The order


def batch_positions(step: int, micro: int, rank: int, *, micro_batch: int, grad_accum: int, world: int) -> range:
    """Stream positions of process ``rank``'s micro batch ``micro`` in optimizer step ``step``."""
    start = ((step * grad_accum + micro) * world + rank) * micro_batch
    return range(start, start + micro_batch)


def stream_index(position: int, n: int, seed: int, _cache: dict = {}) -> int:
    """Example index at ``position`` of the endless stream of seeded per-epoch permutations of n."""
    epoch, offset = divmod(position, n)
    key = (n, seed, epoch)
    if key not in _cache:
        if len(_cache) > 4:
            _cache.clear()
        _cache[key] = np.random.default_rng([seed, epoch]).permutation(n)
    return int(_cache[key][offset])


# ----------------------------------------------------------------------------------------------
# Batches


def pack_rows(lengths: list[int], pack_tokens: int) -> list[list[int]]:
    """Which examples share a row when a micro batch is packed: first-fit decreasing into rows of at
    most ``pack_tokens`` tokens (longest first, ties by order); each row lists its examples in order.
    With ``pack_tokens`` 0 every example has a row of its own."""
    if pack_tokens <= 0:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > pack_tokens:
            raise SelfdraftError(f"a conversation of {lengths[i]} tokens does not fit a packed row of train.pack_tokens="
                                 f"{pack_tokens}: set train.pack_tokens >= data.max_length")
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(pack_tokens)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return [sorted(row) for row in rows]


def placement(lengths: list[int], pack_tokens: int) -> list[tuple[int, int]]:
    """(row, start) of each example in a batch laid out by :func:`pack_rows`."""
    where = [(0, 0)] * len(lengths)
    for r, row in enumerate(pack_rows(lengths, pack_tokens)):
        start = 0
        for i in row:
            where[i] = (r, start)
            start += lengths[i]
    return where


def collate(examples: list[tuple[np.ndarray, np.ndarray]], pad_id: int, device,
            pack_tokens: int = 0) -> dict[str, torch.Tensor]:
    """One batch of (R, T) tensors from a list of (input_ids, loss_mask), T >= MIN_BATCH_LENGTH.

    Unpacked (``pack_tokens`` 0): a row per example, right-padded. Packed: the examples share rows of
    at most ``pack_tokens`` tokens (:func:`pack_rows`), one after another, and ``position_ids`` (R, T)
    restart at 0 where each begins; the padding at a row's end is a block of its own (positions from
    0 again), and ``attention_mask`` is 0 there. A position's conversation is the number of zeros in
    ``position_ids`` up to it: the target and the drafters attend within it only."""
    where = placement([len(ids) for ids, _ in examples], pack_tokens)
    R = 1 + max(r for r, _ in where)
    ends = [0] * R  # where each row's tokens end
    for (r, start), (x, _) in zip(where, examples):
        ends[r] = max(ends[r], start + len(x))
    T = max(MIN_BATCH_LENGTH, *ends)
    ids = np.full((R, T), pad_id, dtype=np.int64)
    attn = np.zeros((R, T), dtype=np.int64)
    mask = np.zeros((R, T), dtype=np.int64)
    pos = np.zeros((R, T), dtype=np.int64)
    for (r, start), (x, m) in zip(where, examples):
        end = start + len(x)
        ids[r, start:end], attn[r, start:end], mask[r, start:end] = x, 1, m
        pos[r, start:end] = np.arange(len(x))
    for r, end in enumerate(ends):
        pos[r, end:] = np.arange(T - end)
    tensors = [("input_ids", ids), ("attention_mask", attn), ("loss_mask", mask)]
    if pack_tokens > 0:
        tensors.append(("position_ids", pos))
    return {k: torch.from_numpy(v).to(device) for k, v in tensors}


def make_batch(data: list, indices: list[int], pad_id: int, device, cache=None, split: str = "train",
               pack_tokens: int = 0, unscored: int = 0) -> dict[str, torch.Tensor]:
    """``collate`` of ``data[indices]``, plus their precomputed target features from ``cache``, laid
    out as ``collate`` lays out their tokens; the last ``unscored`` examples with their loss mask
    zeroed (they run through every module and count nothing)."""
    examples = [data[i] for i in indices]
    for k in range(len(examples) - unscored, len(examples)):
        examples[k] = (examples[k][0], np.zeros_like(examples[k][1]))
    batch = collate(examples, pad_id, device, pack_tokens)
    if cache is not None:
        batch["features"] = cache.batch(split, indices, batch["input_ids"].shape[1], device,
                                        placement=placement([len(ids) for ids, _ in examples], pack_tokens),
                                        rows=batch["input_ids"].shape[0])
    return batch


def step_batches(data: list, step: int, rank: int, config: RunConfig, world: int, pad_id: int, device, cache=None):
    """The micro batches process ``rank`` trains on in optimizer step ``step``, one at a time."""
    t = config.train
    for micro in range(t.grad_accum):
        positions = batch_positions(step, micro, rank, micro_batch=t.micro_batch_size, grad_accum=t.grad_accum, world=world)
        yield make_batch(data, [stream_index(p, len(data), t.seed) for p in positions], pad_id, device, cache,
                         pack_tokens=t.pack_tokens)
