"""Confidence-scheduled verification: verify the part of a draft tree that buys the most tokens per
second, with the target's verify cost measured on this machine.

A drafter may give each node of its tree a *value*: its estimate of the probability that the target
accepts the path to that node (DSpark: the product of its confidence head's outputs along the path;
DFlash: the product of its own probabilities of the tokens it drafted). A step that verifies the
node set S emits 1 + sum of the values in S tokens on average (the target's own token always comes)
and costs T(|S| + 1) + D: one target forward over the root and S, read off the cost curve measured
here (:class:`VerifyCost`), plus the drafting time D (:func:`draft_cost`). :meth:`VerifySchedule.cut` keeps the M nodes of
highest value (values never grow along a path, so the M best are a tree: a parent ranks before its
child) for the M with the highest ratio; M = 0 is a plain step.

Exactness: the kept nodes depend only on the drafter's state, never on the target's answer to this
step, so verification keeps greedy output token-identical and sampled output lossless, as for any
tree the drafter could have proposed itself.

The cost curve is measured once per (machine, target, dtype, device, threads), the drafting time once
per drafter shape on top of that, and both are cached as JSON under ``$SELFDRAFT_CACHE`` (default
``~/.cache/selfdraft``)/``costs/``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import pathlib
import random
import statistics
import time
from dataclasses import asdict, dataclass

from selfdraft.errors import SelfdraftError
from selfdraft.files import write_atomic
from selfdraft.inference.tree import DraftTree, build_tree_buffers
from selfdraft.machine import describe

COST_CONTEXT = 256
"""Tokens already in the cache when the verify cost is measured (a typical mid-answer context)."""
COST_TOKENS = 32
"""The cost curve is measured up to at least this many tokens per forward (one curve per target serves
every drafter of a CPU's small trees; a larger tree measures further)."""
_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


def cost_sizes(max_tokens: int) -> tuple[int, ...]:
    """The forward sizes measured for a curve up to ``max_tokens``: every size up to 6, then a sparser
    grid (the curve is smooth between them), and ``max_tokens`` itself."""
    return tuple(sorted({m for m in _GRID if m <= max_tokens} | {max_tokens}))


@dataclass(frozen=True)
class VerifyCost:
    """T(m): seconds of one target forward over m new tokens (the root and m - 1 drafts), measured at
    ``context`` cached tokens on ``machine`` for the forward sizes ``sizes`` (``seconds[i]`` is
    T(sizes[i]); None: the sizes 1, 2, ..., len(seconds))."""

    seconds: tuple[float, ...]
    target: str
    dtype: str
    device: str
    context: int
    machine: dict
    sizes: tuple[int, ...] | None = None

    def __post_init__(self):
        sizes = self.measured_sizes()
        if len(sizes) != len(self.seconds) or not sizes or sizes[0] != 1 or list(sizes) != sorted(set(sizes)):
            raise SelfdraftError(f"a cost curve needs increasing sizes from 1, one time each; got sizes {list(sizes)} "
                                 f"for {len(self.seconds)} times")

    def measured_sizes(self) -> tuple[int, ...]:
        return self.sizes if self.sizes is not None else tuple(range(1, len(self.seconds) + 1))

    def __call__(self, m: int) -> float:
        """T(m): linear between measured sizes; beyond the largest, extended along the mean slope of the curve."""
        sizes, s = self.measured_sizes(), self.seconds
        m = max(m, 1)
        if m >= sizes[-1]:
            slope = max(0.0, (s[-1] - s[0]) / (sizes[-1] - 1)) if sizes[-1] > 1 else 0.0
            return s[-1] + slope * (m - sizes[-1])
        i = bisect.bisect_right(sizes, m) - 1  # sizes[i] <= m < sizes[i + 1]
        if sizes[i] == m:
            return s[i]
        w = (m - sizes[i]) / (sizes[i + 1] - sizes[i])
        return s[i] + w * (s[i + 1] - s[i])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VerifyCost":
        sizes = d.get("sizes")
        return cls(**{**d, "seconds": tuple(d["seconds"]), "sizes": tuple(sizes) if sizes is not None else None})


def _timed_verify(session, tree: DraftTree, root: int, context: int) -> float:
    buffers = build_tree_buffers(tree)
    start = time.perf_counter()
    out = session.verify(root, tree, buffers)
    float(out.logits[-1, 0])  # wait for the device (one element back to the host)
    elapsed = time.perf_counter() - start
    session.crop(context)
    return elapsed


def measure_verify_cost(target, max_tokens: int, *, context: int = COST_CONTEXT, reps: int = 5) -> VerifyCost:
    """Time the target's forward over a chain of m new tokens, m in :func:`cost_sizes` (max_tokens), after
    ``context`` cached tokens (median of ``reps`` after two warm-ups; random token ids: the cost does not
    depend on them)."""
    from selfdraft.inference.session import CausalLMSession

    if max_tokens < 1:
        raise SelfdraftError(f"max_tokens must be >= 1, got {max_tokens}")
    model = target.model
    text = model.config.get_text_config()
    limit = int(getattr(text, "max_position_embeddings", context + max_tokens + 1) or context + max_tokens + 1)
    context = max(1, min(context, limit - max_tokens - 1))
    rng = random.Random(0)
    session = CausalLMSession(model)
    session.prefill([rng.randrange(text.vocab_size) for _ in range(context)])
    seconds, sizes = [], cost_sizes(max_tokens)
    for m in sizes:
        tree = DraftTree.chain([rng.randrange(text.vocab_size) for _ in range(m - 1)])
        samples = [_timed_verify(session, tree, rng.randrange(text.vocab_size), context) for _ in range(reps + 2)][2:]
        seconds.append(statistics.median(samples))
    # Noise can make a larger forward read faster than a smaller one; the schedule wants a curve that
    # never falls (a running maximum from the left is what the larger forward costs at least).
    for i in range(1, len(seconds)):
        seconds[i] = max(seconds[i], seconds[i - 1])
    return VerifyCost(tuple(seconds), target.identity.name, str(model.dtype).replace("torch.", ""), str(model.device),
                      context, describe(str(model.device)), sizes)


def cost_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder of the cached costs: ``cache_dir``, else ``$SELFDRAFT_CACHE/costs``, else ``~/.cache/selfdraft/costs``."""
    return pathlib.Path(os.path.expanduser(cache_dir or os.environ.get("SELFDRAFT_CACHE") or "~/.cache/selfdraft")) / "costs"


def cost_cache_path(target, max_tokens: int, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where the cost curve of ``target`` on this machine is cached."""
    from selfdraft.heads.small_batch import kernel_signature

    model = target.model
    key = json.dumps({"machine": describe(str(model.device)), "target": target.identity.to_dict(),
                      "dtype": str(model.dtype), "device": str(model.device), "max_tokens": max_tokens,
                      "context": COST_CONTEXT, "few_row_kernel": kernel_signature(model)}, sort_keys=True, default=str)
    return cost_dir(cache_dir) / f"{target.identity.name.replace('/', '_')}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def verify_cost(target, max_tokens: int, cache_dir: str | os.PathLike | None = None) -> VerifyCost:
    """The cached cost curve of ``target`` on this machine up to ``max_tokens`` tokens per forward,
    measured on first use (a few seconds) and written atomically."""
    path = cost_cache_path(target, max_tokens, cache_dir)
    if path.exists():
        try:
            return VerifyCost.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):
            pass  # a damaged cache file is measured again and replaced
    cost = measure_verify_cost(target, max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(cost.to_dict(), indent=1))
    return cost


def measure_draft_cost(target, drafter, *, context: int = COST_CONTEXT, reps: int = 5, rows: int = 1) -> float:
    """Seconds of one ``drafter.propose`` after ``context`` random tokens, the drafter caught up on them
    (median of ``reps`` after two warm-ups); with ``rows`` > 1, of one ``drafter.propose_batch`` of that
    many such rows (a batch of one is one proposal)."""
    from selfdraft.inference.session import CausalLMSession

    text = target.model.config.get_text_config()
    rng = random.Random(1)
    ids = [rng.randrange(text.vocab_size) for _ in range(context)]
    session = CausalLMSession(target.model, hidden_layers=drafter.hidden_layers)
    state = drafter.start(ids, session.prefill(ids))
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
            "max_nodes": drafter.max_nodes, "valued_nodes": drafter.valued_nodes,
            "hidden_layers": list(drafter.hidden_layers), "config": repr(getattr(drafter, "config", None)),
            "parameters": hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]}


def draft_cost(target, drafter, cache_dir: str | os.PathLike | None = None, rows: int = 1) -> float:
    """:func:`measure_draft_cost` of ``drafter`` with ``target`` on this machine (one proposal, or one
    ``propose_batch`` of ``rows`` rows), measured once per drafter shape (class, tree, module shapes) and
    cached beside the verify cost, so that the decisions it feeds (the schedule's cut, the adaptive
    throttle) are the same from run to run and a seeded sampled run is reproducible."""
    verify_path = cost_cache_path(target, 1, cache_dir)
    shape = _drafter_shape(drafter)
    key = json.dumps({"verify": verify_path.name, "drafter": shape, **({"rows": rows} if rows != 1 else {})},
                     sort_keys=True)
    path = verify_path.with_name(f"draft-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")
    if path.exists():
        try:
            return float(json.loads(path.read_text())["seconds"])
        except (ValueError, TypeError, KeyError):
            pass  # damaged: measured again and replaced
    seconds = measure_draft_cost(target, drafter, rows=rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"seconds": seconds, "rows": rows, "drafter": shape}, indent=1))
    return seconds


@dataclass(frozen=True)
class VerifySchedule:
    """Cuts each valued draft tree to the node set with the most expected tokens per second.

    ``draft_seconds``: the drafter's cost per step (:func:`draft_cost`, cached: a cut that read each
    step's own clock would make seeded sampling irreproducible)."""

    cost: VerifyCost
    draft_seconds: float = 0.0

    def best_size(self, values: list[float]) -> tuple[int, list[int]]:
        """(M, the M kept node indices in tree order) for node ``values`` already made non-increasing
        along paths; ties keep the smaller M."""
        order = sorted(range(len(values)), key=lambda i: (-values[i], i))
        best_m, best_rate, gain = 0, 1.0 / (self.cost(1) + self.draft_seconds), 1.0
        for m, i in enumerate(order, start=1):
            gain += values[i]
            rate = gain / (self.cost(m + 1) + self.draft_seconds)
            if rate > best_rate * (1 + 1e-9):
                best_m, best_rate = m, rate
        return best_m, sorted(order[:best_m])

    def cut(self, tree: DraftTree) -> DraftTree:
        """``tree`` cut to its best node set; a tree without values is returned whole."""
        if tree.values is None or tree.num_nodes == 0:
            return tree
        parents = tree.parent_ids
        values = list(tree.values)
        for i, p in enumerate(parents):  # a path is accepted no more often than its prefix
            if p >= 0:
                values[i] = min(values[i], values[p])
        m, keep = self.best_size(values)
        if m == tree.num_nodes:
            return tree
        return tree.subtree(keep)


SCHEDULES = ("confidence", "off")


def schedule_for(target, drafter, mode: str = "confidence") -> VerifySchedule | None:
    """The schedule a decode with ``drafter`` uses: ``confidence`` (the default) where its trees carry
    node values (a block drafter's), with this machine's cost curve for its largest tree; None for
    ``off`` or a drafter whose trees carry none."""
    if mode not in SCHEDULES:
        raise SelfdraftError(f"unknown schedule {mode!r}; choose one of {', '.join(SCHEDULES)}")
    if mode == "off" or not drafter.valued_nodes:
        return None
    return VerifySchedule(verify_cost(target, max(COST_TOKENS, drafter.valued_nodes + 1)), draft_cost(target, drafter))
