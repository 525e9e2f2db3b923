"""Confidence-scheduled verification: verify the part of a draft tree that buys the most tokens per
second, with the target's verify cost measured on this machine.

A drafter may give each node of its tree a *value*: its estimate of the probability that the target
accepts the path to that node (DSpark: the product of its confidence head's outputs along the path;
DFlash: the product of its own probabilities of the tokens it drafted). A step that verifies the
node set S emits 1 + sum of the values in S tokens on average (the target's own token always comes)
and costs T(|S| + 1) + D: one target forward over the root and S, read off the cost curve measured
here (:class:`VerifyCost`), plus the drafting time D (measured once per schedule). :meth:`VerifySchedule.cut` keeps the M nodes of
highest value (values never grow along a path, so the M best are a tree: a parent ranks before its
child) for the M with the highest ratio; M = 0 is a plain step.

Exactness: the kept nodes depend only on the drafter's state, never on the target's answer to this
step, so verification keeps greedy output token-identical and sampled output lossless, as for any
tree the drafter could have proposed itself.

The cost curve is measured once per (machine, target, dtype, device, threads) and cached as JSON
under ``$SELFDRAFT_CACHE`` (default ``~/.cache/selfdraft``)/``costs/``.
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

from selfdraft.errors import SelfdraftError
from selfdraft.inference.tree import DraftTree, build_tree_buffers
from selfdraft.machine import describe

COST_CONTEXT = 256
"""Tokens already in the cache when the verify cost is measured (a typical mid-answer context)."""


@dataclass(frozen=True)
class VerifyCost:
    """T(m): seconds of one target forward over m new tokens (the root and m - 1 drafts), m = 1, 2, ...
    (``seconds[m - 1]``), measured at ``context`` cached tokens on ``machine``."""

    seconds: tuple[float, ...]
    target: str
    dtype: str
    device: str
    context: int
    machine: dict

    def __call__(self, m: int) -> float:
        """T(m); beyond the measured sizes, extended along the last measured step's slope."""
        s = self.seconds
        if m <= len(s):
            return s[max(m, 1) - 1]
        slope = max(0.0, (s[-1] - s[0]) / max(1, len(s) - 1))
        return s[-1] + slope * (m - len(s))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VerifyCost":
        return cls(**{**d, "seconds": tuple(d["seconds"])})


def _timed_verify(session, tree: DraftTree, root: int, context: int) -> float:
    buffers = build_tree_buffers(tree)
    start = time.perf_counter()
    out = session.verify(root, tree, buffers)
    float(out.logits[-1, 0])  # wait for the device (one element back to the host)
    elapsed = time.perf_counter() - start
    session.crop(context)
    return elapsed


def measure_verify_cost(target, max_tokens: int, *, context: int = COST_CONTEXT, reps: int = 5) -> VerifyCost:
    """Time the target's forward over a chain of m = 1..max_tokens new tokens after ``context`` cached
    tokens (median of ``reps`` after two warm-ups; random token ids: the cost does not depend on them)."""
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
    seconds = []
    for m in range(1, max_tokens + 1):
        tree = DraftTree.chain([rng.randrange(text.vocab_size) for _ in range(m - 1)])
        samples = [_timed_verify(session, tree, rng.randrange(text.vocab_size), context) for _ in range(reps + 2)][2:]
        seconds.append(statistics.median(samples))
    # Noise can make a larger forward read faster than a smaller one; the schedule wants a curve that
    # never falls (a running maximum from the left is what the larger forward costs at least).
    for i in range(1, len(seconds)):
        seconds[i] = max(seconds[i], seconds[i - 1])
    return VerifyCost(tuple(seconds), target.identity.name, str(model.dtype).replace("torch.", ""), str(model.device),
                      context, describe(str(model.device)))


def cost_cache_path(target, max_tokens: int, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where the cost curve of ``target`` on this machine is cached."""
    model = target.model
    key = json.dumps({"machine": describe(str(model.device)), "target": target.identity.to_dict(),
                      "dtype": str(model.dtype), "device": str(model.device), "max_tokens": max_tokens,
                      "context": COST_CONTEXT}, sort_keys=True, default=str)
    root = pathlib.Path(os.path.expanduser(cache_dir or os.environ.get("SELFDRAFT_CACHE") or "~/.cache/selfdraft"))
    return root / "costs" / f"{target.identity.name.replace('/', '_')}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def verify_cost(target, max_tokens: int, cache_dir: str | os.PathLike | None = None) -> VerifyCost:
    """The cached cost curve of ``target`` on this machine up to ``max_tokens``, measured on first use
    (a few seconds) and written atomically."""
    path = cost_cache_path(target, max_tokens, cache_dir)
    if path.exists():
        try:
            return VerifyCost.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):
            pass  # a damaged cache file is measured again and replaced
    cost = measure_verify_cost(target, max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cost.to_dict(), indent=1))
    os.replace(tmp, path)
    return cost


def measure_draft_cost(target, drafter, *, context: int = COST_CONTEXT, reps: int = 5) -> float:
    """Seconds of one ``drafter.propose`` after ``context`` random tokens (median of ``reps`` after two
    warm-ups)."""
    from selfdraft.inference.session import CausalLMSession

    text = target.model.config.get_text_config()
    rng = random.Random(1)
    ids = [rng.randrange(text.vocab_size) for _ in range(context)]
    session = CausalLMSession(target.model, hidden_layers=drafter.hidden_layers)
    state = drafter.start(ids, session.prefill(ids))
    sequence = ids + [rng.randrange(text.vocab_size)]
    samples = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        drafter.propose(state, sequence)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:])


@dataclass(frozen=True)
class VerifySchedule:
    """Cuts each valued draft tree to the node set with the most expected tokens per second.

    ``draft_seconds``: the drafter's cost per step (measured once, when the schedule is made: a cut
    that read each step's own clock would make seeded sampling irreproducible)."""

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
    return VerifySchedule(verify_cost(target, drafter.valued_nodes + 1), measure_draft_cost(target, drafter))
