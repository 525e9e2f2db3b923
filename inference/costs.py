"""What a step costs on this machine, and whether drafting pays: the one cost model of the decoder.

Two measured costs, each measured once per (machine, target, dtype, device, threads, kernel choice) and
cached as JSON under ``$SELFDRAFT_CACHE`` (default ``~/.cache/selfdraft``)/``costs/``:

* T(B, m), the :class:`CostSurface`: seconds of one target forward over B rows of m new tokens each (a
  row's root and m - 1 drafts), every row after ``COST_CONTEXT`` cached tokens. Batch 1 is its first
  row (:func:`verify_cost`); a batched decode adds the rows of the batch sizes it needs. A cell is
  measured once: a later grid reuses every row it covers.
* D(B), :func:`draft_cost`: seconds of one proposal of a drafter for B rows (one ``propose_batch``),
  once per drafter shape (class, tree, module shapes).

A drafted step that verifies m - 1 draft nodes per row and emits E tokens per row on average costs
T(B, m) + D(B) and a plain step T(B, 1) for one token per row, so drafting pays when
:func:`speedup` = E T(B, 1) / (T(B, m) + D(B)) is above 1 (:func:`pays`, with a slack). Every decision
about how much to draft (the drafting policy of inference/policy.py, the speculation schedule, the hybrid's
split between copying and its drafter) reads these two costs and this one test. They are measured
once, never read off a clock during decoding, so the decisions depend only on what the target accepted
and a seeded sampled run is reproducible.

Whether drafting pays at B depends on T(B, m) / T(B, 1): near 1 where the forward is bound by reading
the weights (small B on a GPU: more tokens per row are almost free), growing towards m where it is bound
by compute (large B, or a CPU). ``selfdraft costs`` prints the surface as a table and plots it
(inference/cost_report.py). Before it allocates anything, a measurement checks that the largest batch's
key/value cache fits the memory left on the device (:func:`~selfdraft.inference.batch.check_batch_fits`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

from selfdraft.errors import SelfdraftError
from selfdraft.files import cache_root, write_atomic
from selfdraft.machine import describe

COST_CONTEXT = 256
"""Tokens already in the cache when a cost is measured (a typical mid-answer context)."""
COST_TOKENS = 32
"""Batch 1's curve is measured up to at least this many tokens per row (one curve per target serves every
drafter of a CPU's small trees; a larger tree measures further)."""
_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


def cost_sizes(max_tokens: int) -> tuple[int, ...]:
    """Tokens per row measured up to ``max_tokens``: every size up to 6, then a sparser grid (the cost is
    smooth between them), and ``max_tokens`` itself."""
    return tuple(sorted({m for m in _GRID if m <= max_tokens} | {max_tokens}))


def speedup(tokens: float, drafted_seconds: float, plain_seconds: float) -> float:
    """Tokens per second of a drafted step that emits ``tokens`` (per row) in ``drafted_seconds``, over a
    plain step's one token in ``plain_seconds``."""
    return tokens * plain_seconds / drafted_seconds if drafted_seconds > 0 else float("inf")


def pays(tokens: float, drafted_seconds: float, plain_seconds: float, slack: float = 0.0) -> bool:
    """Does the drafted step emit tokens faster than plain decoding, allowing it to lose ``slack`` of the
    plain rate (a drafter that costs next to nothing is not switched off for its tiny cost)?"""
    return tokens * plain_seconds > (1.0 - slack) * drafted_seconds


@dataclass(frozen=True)
class CostSurface:
    """``seconds[i][j]`` = T(batch_sizes[i], tokens[j])."""

    batch_sizes: tuple[int, ...]
    tokens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    target: str
    dtype: str
    device: str
    context: int
    machine: dict

    def __post_init__(self):
        for name in ("batch_sizes", "tokens"):
            values = getattr(self, name)
            if not values or values[0] < 1 or list(values) != sorted(set(values)):
                raise SelfdraftError(f"a cost surface needs increasing positive {name}, got {list(values)}")
        if len(self.seconds) != len(self.batch_sizes) or any(len(r) != len(self.tokens) for r in self.seconds):
            raise SelfdraftError(f"a cost surface needs {len(self.batch_sizes)} x {len(self.tokens)} times")

    def __call__(self, batch: int, m: int) -> float:
        """T(batch, m): linear in m, then in batch, between grid points; beyond the largest along the last
        segment's slope, below the smallest the smallest's (the one interpolation of every decision)."""
        return _interpolate(self.batch_sizes, [_interpolate(self.tokens, row, m) for row in self.seconds], batch)

    @classmethod
    def row(cls, seconds, tokens=None, *, batch: int = 1, target: str = "", dtype: str = "", device: str = "",
            context: int = COST_CONTEXT, machine: dict | None = None) -> "CostSurface":
        """A surface of one batch size: T(batch, tokens[i]) = seconds[i] (tokens: 1, 2, ..., len(seconds) unless given)."""
        tokens = tuple(tokens) if tokens is not None else tuple(range(1, len(seconds) + 1))
        return cls((batch,), tokens, (tuple(seconds),), target, dtype, device, context, machine or {})

    def relative(self, batch: int, m: int) -> float:
        """T(batch, m) / T(batch, 1): what verifying m - 1 drafts per row costs, in plain steps."""
        return self(batch, m) / self(batch, 1)

    def table(self) -> str:
        """Markdown: T in ms per (batch, tokens per row), and T(B, m) / T(B, 1) below each time."""
        head = "| batch \\ tokens per row | " + " | ".join(str(m) for m in self.tokens) + " |"
        rule = "|---|" + "---|" * len(self.tokens)
        rows = [f"| {b} | " + " | ".join(f"{1e3 * t:.1f} ms ({t / r[0]:.2f}x)" for t in r) + " |"
                for b, r in zip(self.batch_sizes, self.seconds)]
        return "\n".join([head, rule, *rows])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostSurface":
        return cls(**{**d, "batch_sizes": tuple(d["batch_sizes"]), "tokens": tuple(d["tokens"]),
                      "seconds": tuple(tuple(r) for r in d["seconds"])})


def _interpolate(xs, ys, x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] if len(xs) == 1 else ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1])
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            w = (x - xs[i]) / (xs[i + 1] - xs[i])
            return ys[i] + w * (ys[i + 1] - ys[i])
    raise AssertionError("unreachable: xs are increasing")


def measure_cost_surface(target, batch_sizes, tokens, *, context: int = COST_CONTEXT, reps: int = 5) -> CostSurface:
    """Time the target's forward over B rows x m new tokens after ``context`` cached tokens per row, for
    every B in ``batch_sizes`` and m in ``tokens`` (median of ``reps`` after one warm-up; random ids)."""
    import torch

    from selfdraft.heads.target_layers import TargetLayers
    from selfdraft.inference.batch import check_batch_fits

    model = target.model
    text = model.config.get_text_config()
    layers = TargetLayers.of(model)  # the decoder's cache, masks and rollback for this family (any layer kinds)
    mask_dtype = next(model.parameters()).dtype
    batch_sizes, tokens = tuple(sorted(set(batch_sizes))), tuple(sorted(set(tokens)))
    CostSurface(batch_sizes, tokens, tuple((0.0,) * len(tokens) for _ in batch_sizes), "", "", "", 0, {})  # checks the grid
    check_batch_fits(model, batch_sizes[-1], context + tokens[-1])
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    seconds = []
    with torch.inference_mode():
        for b in batch_sizes:
            cache = layers.new_cache(model)
            ids = torch.randint(text.vocab_size, (b, context), generator=gen).to(model.device)
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            layers.start_recording(cache)  # recurrent layers: so that crop() rolls them back
            row = []
            for m in tokens:
                positions = torch.arange(context, context + m, device=model.device).expand(b, m)
                # The masks a batched verify of a chain feeds (inference/batch.py): every cached token visible,
                # causal among the new ones; sliding and chunked layers get their windows.
                keys = torch.arange(context + m, device=model.device).expand(b, context + m)
                visible = keys[:, None, :] <= positions[:, :, None]  # (b, m, context + m)
                mask = layers.masks(visible, positions, keys, mask_dtype)
                samples = []
                for _ in range(reps + 1):
                    new = torch.tensor([[rng.randrange(text.vocab_size) for _ in range(m)] for _ in range(b)],
                                       device=model.device)
                    start = time.perf_counter()
                    out = model(input_ids=new, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True)
                    float(out.logits[-1, -1, 0])  # wait for the device
                    samples.append(time.perf_counter() - start)
                    cache.crop(-m)  # back to the context (transformers: a negative count drops tokens)
                row.append(statistics.median(samples[1:]))
            for j in range(1, len(row)):  # a larger forward costs at least what a smaller one does
                row[j] = max(row[j], row[j - 1])
            seconds.append(tuple(row))
            del cache
    return CostSurface(batch_sizes, tokens, tuple(seconds), target.identity.name,
                       str(model.dtype).replace("torch.", ""), str(model.device), context, describe(str(model.device)))


def cost_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder of the cached costs: ``cache_dir``, else ``$SELFDRAFT_CACHE/costs``, else ``~/.cache/selfdraft/costs``."""
    return cache_root(cache_dir) / "costs"


def _cost_file(target, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The one file of ``target``'s verify costs on this machine (every batch size and token count measured)."""
    from selfdraft.heads.small_batch import kernel_signature

    model = target.model
    key = json.dumps({"machine": describe(str(model.device)), "target": target.identity.to_dict(), "dtype": str(model.dtype),
                      "device": str(model.device), "context": COST_CONTEXT, "few_row_kernel": kernel_signature(model)},
                     sort_keys=True, default=str)
    return cost_dir(cache_dir) / f"{target.identity.name.replace('/', '_')}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_cells(path: pathlib.Path) -> tuple[dict[tuple[int, int], float], dict | None]:
    """The measured cells {(batch, tokens): seconds} of a cost file and its surface's description; a
    missing or damaged file has none (it is measured again and replaced)."""
    try:
        data = json.loads(path.read_text())
        cells = {(int(b), int(m)): float(t) for b, m, t in data["cells"]}
        return cells, data["about"]
    except (OSError, ValueError, TypeError, KeyError):
        return {}, None


def cost_surface(target, batch_sizes, tokens, cache_dir: str | os.PathLike | None = None) -> CostSurface:
    """T(B, m) of ``target`` on this machine on the grid ``batch_sizes`` x ``tokens``. Every batch size the
    cache lacks a cell of is measured (:func:`measure_cost_surface`, over the tokens of that row it already
    has as well, so a row stays one measurement) and added to the cache (written atomically)."""
    batch_sizes, tokens = tuple(sorted(set(batch_sizes))), tuple(sorted(set(tokens)))
    path = _cost_file(target, cache_dir)
    cells, about = _read_cells(path)
    missing = [b for b in batch_sizes if any((b, m) not in cells for m in tokens)]
    if missing:
        row_tokens = sorted(set(tokens) | {m for (b, m) in cells if b in missing})
        measured = measure_cost_surface(target, missing, row_tokens)
        about = {k: v for k, v in measured.to_dict().items() if k not in ("batch_sizes", "tokens", "seconds")}
        for b, row in zip(measured.batch_sizes, measured.seconds):
            cells.update({(b, m): t for m, t in zip(measured.tokens, row)})
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"about": about, "cells": [[b, m, t] for (b, m), t in sorted(cells.items())]}, indent=1))
    return CostSurface(batch_sizes, tokens, tuple(tuple(cells[b, m] for m in tokens) for b in batch_sizes), **about)


def verify_cost(target, max_tokens: int, cache_dir: str | os.PathLike | None = None) -> CostSurface:
    """Batch 1's row of the cost surface, over :func:`cost_sizes` (max_tokens): what a decode of one prompt
    at a time weighs its drafts with."""
    if max_tokens < 1:
        raise SelfdraftError(f"max_tokens must be >= 1, got {max_tokens}")
    return cost_surface(target, (1,), cost_sizes(max_tokens), cache_dir)


def measure_draft_cost(target, drafter, *, context: int = COST_CONTEXT, reps: int = 5, rows: int = 1) -> float:
    """Seconds of one ``drafter.propose`` after ``context`` random tokens, the drafter caught up on them
    (median of ``reps`` after two warm-ups); with ``rows`` > 1, of one ``drafter.propose_batch`` of that
    many such rows (a batch of one is one proposal)."""
    from selfdraft.inference.batch import BatchSession

    text = target.model.config.get_text_config()
    rng = random.Random(1)
    ids = [rng.randrange(text.vocab_size) for _ in range(context)]
    session = BatchSession(target.model, hidden_layers=drafter.hidden_layers)
    state = drafter.start(ids, session.prefill([ids])[0])
    sequence = ids + [rng.randrange(text.vocab_size)]
    _, state = drafter.propose(state, sequence)  # the drafter catches up on the prompt once, as in a decode
    samples = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        drafter.propose_batch([state] * rows, [sequence] * rows)  # one row: one propose
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:])


def _drafter_shape(drafter) -> dict:
    """What a drafter's proposal cost depends on: its class, tree and the shapes of the modules it runs
    (not their values: a trained and a random drafter of one shape cost the same)."""
    from torch import nn

    from selfdraft.inference.drafters import Drafter

    def modules(obj, prefix=""):  # the drafter's modules, and those of the drafters it wraps (a hybrid's)
        for name, m in sorted(vars(obj).items()):
            if isinstance(m, nn.Module):
                yield f"{prefix}{name}", m
            elif isinstance(m, Drafter):
                yield from modules(m, f"{prefix}{name}.")

    shapes = sorted(f"{name}.{n}:{tuple(p.shape)}:{p.dtype}:{p.device}" for name, m in modules(drafter)
                    for n, p in m.named_parameters())
    return {"class": f"{type(drafter).__module__}.{type(drafter).__qualname__}", "name": drafter.name,
            "max_nodes": drafter.max_nodes,
            "hidden_layers": list(drafter.hidden_layers), "config": repr(getattr(drafter, "config", None)),
            "parameters": hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]}


def draft_cost(target, drafter, cache_dir: str | os.PathLike | None = None, rows: int = 1) -> float:
    """D(rows): :func:`measure_draft_cost` of ``drafter`` with ``target`` on this machine (one proposal, or one
    ``propose_batch`` of ``rows`` rows), measured once per drafter shape (class, tree, module shapes) and
    cached beside the verify costs."""
    shape = _drafter_shape(drafter)
    key = json.dumps({"verify": _cost_file(target, cache_dir).name, "drafter": shape, **({"rows": rows} if rows != 1 else {})},
                     sort_keys=True)
    path = cost_dir(cache_dir) / f"draft-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        try:
            return float(json.loads(path.read_text())["seconds"])
        except (ValueError, TypeError, KeyError):
            pass  # damaged: measured again and replaced
    seconds = measure_draft_cost(target, drafter, rows=rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"seconds": seconds, "rows": rows, "drafter": shape}, indent=1))
    return seconds


def batch_draft_cost(target, drafter, batch_sizes) -> Callable[[int], float]:
    """rows -> D(rows) for a batch of ``drafter``: rows times one proposal for a drafter that drafts row by
    row; for a batched one, measured at one row and at the largest of ``batch_sizes``, linear between and beyond."""
    one = draft_cost(target, drafter)
    if not drafter.batched:
        return lambda rows: rows * one
    most = max(batch_sizes)
    per_row = max(draft_cost(target, drafter, rows=most) - one, 0.0) / (most - 1) if most > 1 else 0.0
    return lambda rows: one + (rows - 1) * per_row
