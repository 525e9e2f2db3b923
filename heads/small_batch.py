"""A faster float32 linear product for the few-row forwards of speculative decoding on a CPU.

A tree verification runs the target over a handful of tokens (2-64 rows), and an EAGLE drafter over
top_k rows per depth. On a CPU, ``F.linear(x, W)`` with a few rows takes a general matrix-multiply path
that costs far more than its one-row matrix-vector path; the same product with the weight as the left
operand, ``(W @ x.T).T``, stays close to the one-row cost. Verifying a small tree then costs about what
one decoding step costs, which is what makes drafting pay on a CPU (by measurement: docs/results/decoding.md).

:meth:`SmallBatchMatmul.apply` gives every ``nn.Linear`` of a module that path for float32 CPU inputs
of 2-64 rows, and returns a handle whose :meth:`~SmallBatchMatmul.remove` gives the layers back their
own ``forward``. One row, more rows, other dtypes (bf16 takes a different kernel on a CPU), other
devices and autograd all take ``F.linear`` unchanged. The product is the same up to float32 rounding
(another summation order, as any change of matrix-multiply kernel gives). The layers get an
instance-level ``forward``: their class, parameters, state dict and hooks are untouched.
Whether it is faster depends on the processor: on some (AMD EPYC, with AVX-512) the general kernel's
few-row cost is several one-row costs and the weight-first product stays near one; on others (Intel
Xeon with AMX) the general kernel is the faster of the two at every row count. So by default (``auto``)
:meth:`SmallBatchMatmul.apply` times both products once per process for each weight shape it meets and
each row count the path serves (2, 3, 4, 5, 8, 16, 32, 64; counts in between take the next measured
one; at most half a second per shape; the verdicts are kept on disk per machine), and a layer takes the weight-first product only at the row counts where it was at least 20%
faster; a layer whose shape never gains is not wrapped. ``SELFDRAFT_SMALL_BATCH_MATMUL=1`` takes it
at every count without timing (what the tests check), ``0`` switches it off for a process, e.g. to
measure what it buys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from selfdraft.files import cache_root, write_atomic

logger = logging.getLogger(__name__)

MAX_ROWS = 64
"""Above this many rows the general kernel is as fast (a prefill keeps it)."""
DIRECT_ROWS = 5
ROW_MULTIPLE = 8
"""Up to DIRECT_ROWS rows go as they are; more are zero-padded to a multiple of ROW_MULTIPLE, the row
counts the weight-first kernel handles at its best (others fall onto slower code paths)."""
ENV = "SELFDRAFT_SMALL_BATCH_MATMUL"


MEASURED_ROWS = (2, 3, 4, 5, 8, 16, 32, 64)
"""Row counts timed in ``auto`` mode; a padded count between two of them takes the next one's verdict."""
_FAST: dict[tuple[int, int, int], frozenset[int]] = {}
"""(out_features, in_features, torch threads) -> the padded row counts where the weight-first product
was measured faster in this process (``auto`` mode)."""


def mode() -> str:
    """``auto`` (the default: where measured faster), ``on`` (every 2-64 row count) or ``off``, from
    ``SELFDRAFT_SMALL_BATCH_MATMUL`` (``auto``, ``1``/``on``, ``0``/``off``)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    return "on" if value in ("1", "true", "yes", "on") else "auto"


def enabled() -> bool:
    """Whether :meth:`SmallBatchMatmul.apply` wraps anything (``SELFDRAFT_SMALL_BATCH_MATMUL`` not 0)."""
    return mode() != "off"


def _padded(rows: int) -> int:
    return rows if rows <= DIRECT_ROWS else -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE


def _best_times(first, second, reps: int = 5) -> tuple[float, float]:
    """The best of ``reps`` timings of each of two functions, run in turn (after one warm-up each), so a
    change of load on the machine affects both alike."""
    first(), second()
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for i, fn in enumerate((first, second)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


MEASURE_SECONDS = 0.5
"""Timing budget per weight shape: row counts not reached within it keep ``F.linear`` (a large target's LM
head would otherwise take seconds to time at every count)."""


def _measure_fast_rows(out_features: int, in_features: int) -> frozenset[int]:
    """The measured row counts (padded) at which the weight-first product beats ``F.linear`` by 20% (a
    smaller margin is within what a whole forward, with its weights out of cache, does not keep)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    reps = 5 if weight.numel() < 4_000_000 else 3  # large weights: fewer, longer, steadier timings
    deadline = time.perf_counter() + MEASURE_SECONDS
    fast = set()
    with torch.inference_mode():
        for rows in MEASURED_ROWS:
            if time.perf_counter() > deadline:
                break
            x = torch.randn(rows, in_features, generator=generator)
            general, weight_first = _best_times(lambda: F.linear(x, weight),
                                                lambda: torch.matmul(weight, x.t()).t().contiguous(), reps)
            if weight_first < 0.8 * general:
                fast.add(rows)
    return frozenset(fast)


def _verdict_file() -> pathlib.Path:
    """Where this machine's verdicts are kept: one file per (processor, its flags, cores, torch, threads)
    under ``$SELFDRAFT_CACHE`` (default ``~/.cache/selfdraft``)/``costs/``, beside the costs measured with them."""
    from selfdraft.machine import describe

    key = json.dumps(describe("cpu"), sort_keys=True, default=str)
    return cache_root() / "costs" / f"few-row-kernel-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def fast_rows(out_features: int, in_features: int) -> frozenset[int]:
    """The padded row counts that take the weight-first product for this weight shape (``auto`` mode):
    measured once per machine and thread count and kept on disk, so that a process decides as the last
    one did (a timing taken under another load could decide otherwise, and every cost measured with the
    kernel choice would then be measured again)."""
    key = (out_features, in_features, torch.get_num_threads())
    if key not in _FAST:
        path, name = _verdict_file(), f"{out_features}x{in_features}"
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        measured = known.get(name)
        if not isinstance(measured, list):
            measured = sorted(_measure_fast_rows(out_features, in_features))
            with contextlib.suppress(OSError):  # a read-only cache: measured again next time
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, json.dumps({**known, name: measured}, indent=1, sort_keys=True))
        _FAST[key] = frozenset(p for p in range(2, MAX_ROWS + 1)
                               if next(r for r in MEASURED_ROWS if r >= p) in measured)
    return _FAST[key]


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // self.in_features if x.dim() >= 2 else 1
    if (2 <= rows <= MAX_ROWS and (mode() == "on" or _padded(rows) in fast_rows(self.out_features, self.in_features))
            and x.dtype == torch.float32 and x.device.type == "cpu"
            and self.weight.dtype == torch.float32 and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
        flat = x.reshape(rows, self.in_features)
        padded = _padded(rows)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        y = torch.matmul(self.weight, flat.t()).t()[:rows].contiguous()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)
    return F.linear(x, self.weight, self.bias)


def _is_wrapped(layer: nn.Module) -> bool:
    return getattr(layer.__dict__.get("forward"), "__func__", None) is _forward


class SmallBatchMatmul:
    """The few-row path on the linear layers of one module: made by :meth:`apply`, undone by :meth:`remove`.

    ``len(handle)`` is how many layers this handle wrapped (0 when every one already had the path, or
    when ``SELFDRAFT_SMALL_BATCH_MATMUL=0``). A ``with`` block removes it at its end.
    """

    def __init__(self, layers: list[nn.Linear], owner: str):
        self._layers = layers
        self.owner = owner  # the wrapped module's class name, for messages

    @classmethod
    def apply(cls, module: nn.Module, *, reason: str = "") -> SmallBatchMatmul:
        """Wrap every plain ``nn.Linear`` in ``module`` (itself included) that has not got the path yet.

        Logs one INFO line with the count and ``reason`` (what the module's few-row forwards are).
        Idempotent: layers already wrapped (by this or another handle) are left to their handle, so
        applying twice wraps nothing the second time, and removing either handle never unwraps the
        other's layers. Subclasses of ``nn.Linear`` (quantised or LoRA layers) and layers whose instance
        already has a ``forward`` of its own (accelerate's offloading hooks) are not touched.
        """
        name = type(module).__name__
        if not enabled():
            logger.debug("few-row float32 kernel not applied to %s: %s=0", name, ENV)
            return cls([], name)
        linear = [m for m in module.modules() if type(m) is nn.Linear and not _is_wrapped(m)]
        layers = [m for m in linear if "forward" not in m.__dict__]
        slower = []
        if mode() == "auto" and layers:
            measured = [m for m in layers if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
            slower = [m for m in measured if not fast_rows(m.out_features, m.in_features)]
            layers = [m for m in layers if all(m is not s for s in slower)]
        for layer in layers:
            layer.forward = types.MethodType(_forward, layer)
        # A forward someone else set on the instance (accelerate's offloading hooks) is theirs: left alone.
        skipped = len(linear) - len(layers) - len(slower)
        foreign = f"; {skipped} with a forward of their own left as they are" if skipped else ""
        kept = f"; {len(slower)} where it was not faster here keep F.linear" if slower else ""
        where = "rows where it was measured faster here, of" if mode() == "auto" else "every count of"
        if layers:
            logger.info("few-row float32 kernel on %d linear layers of %s%s, for the %s 2-%d rows%s%s "
                        "(%s=0 turns it off, =1 takes it without timing)", len(layers), name,
                        f" for {reason}" if reason else "", where, MAX_ROWS, kept, foreign, ENV)
        elif slower:
            logger.info("few-row float32 kernel not applied to %s: the general kernel was as fast or faster here "
                        "for its %d linear layers' shapes (%s=1 forces it)", name, len(slower), ENV)
        return cls(layers, name)

    def remove(self) -> None:
        """Give every layer this handle wrapped its class's ``forward`` back (bit-identical outputs to a
        layer never wrapped). Idempotent."""
        for layer in self._layers:
            if _is_wrapped(layer):
                del layer.forward
        if self._layers:
            logger.debug("few-row float32 kernel removed from %d linear layers of %s", len(self._layers), self.owner)
        self._layers = []

    def __len__(self) -> int:
        return len(self._layers)

    def __enter__(self) -> SmallBatchMatmul:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"SmallBatchMatmul({self.owner}: {len(self)} layers)"


def use_small_batch_matmul(module: nn.Module, *, reason: str = "") -> SmallBatchMatmul:
    """:meth:`SmallBatchMatmul.apply`: give every ``nn.Linear`` in ``module`` the few-row path; returns
    the handle (``len()`` layers wrapped now, ``.remove()`` to undo)."""
    return SmallBatchMatmul.apply(module, reason=reason)


def uses_small_batch_matmul(module: nn.Module) -> bool:
    """Whether any ``nn.Linear`` in ``module`` has the few-row path."""
    return any(_is_wrapped(layer) for layer in module.modules() if isinstance(layer, nn.Linear))


def kernel_signature(module: nn.Module) -> str:
    """Which products ``module``'s linear layers take for few rows (the mode, and per wrapped shape the row
    counts of the weight-first product): part of the key of every cost measured with it."""
    wrapped = sorted({(m.out_features, m.in_features) for m in module.modules()
                      if isinstance(m, nn.Linear) and _is_wrapped(m)})
    if mode() == "on":
        return f"on:{wrapped}"
    return f"{mode()}:" + ";".join(f"{o}x{i}:{sorted(fast_rows(o, i))}" for o, i in wrapped)

